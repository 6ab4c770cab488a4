"""Distillation divergences: checked against independent numpy/scipy computations and known inequalities."""

from __future__ import annotations

import math

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from scipy.spatial.distance import jensenshannon
from scipy.stats import entropy

from specdistill.training.losses import LOSSES, LossError, Teacher, build_loss, dpace_weights, masked_mean

torch.set_num_threads(1)
SETTINGS = settings(max_examples=60, deadline=None)
ALL = ["fkl", "rkl", "jsd", "tvd", "topk_kl", "ce", "lk"]
TEMPERATURES = st.sampled_from([0.5, 1.0, 2.0])


@st.composite
def logit_pairs(draw, max_abs: float = 6.0):
    """(student, teacher, targets): float32 logits [N, V] with N in 1..5, V in 2..12."""
    n, v = draw(st.integers(1, 5)), draw(st.integers(2, 12))
    el = st.floats(-max_abs, max_abs, allow_nan=False, width=32)
    s = draw(hnp.arrays(np.float32, (n, v), elements=el))
    t = draw(hnp.arrays(np.float32, (n, v), elements=el))
    targets = draw(hnp.arrays(np.int64, (n,), elements=st.integers(0, v - 1)))
    return s, t, targets


def softmax(z: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = z.astype(np.float64) / temperature
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def per_token(name: str, s, t, targets=None, temperature: float = 1.0, **params) -> np.ndarray:
    loss = build_loss(name, temperature=temperature, **params)
    tt = None if targets is None else torch.as_tensor(targets)
    return loss.per_token(torch.as_tensor(s), Teacher(logits=torch.as_tensor(t)), tt).double().numpy()


def stored_topk(t: np.ndarray, k: int) -> Teacher:
    """What the generate stage stores: the top-k of log_softmax at temperature 1."""
    lp, ids = torch.log_softmax(torch.as_tensor(t), -1).topk(k, -1)
    return Teacher(topk_ids=ids, topk_logprobs=lp)


# --- basic properties -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, params", [(n, {}) for n in ALL] + [("jsd", {"beta": 0.2}), ("topk_kl", {"k": 2}),
                                                                   ("lk", {"variant": "alpha"})])
@SETTINGS
@given(data=logit_pairs(), temperature=TEMPERATURES)
def test_every_divergence_is_nonnegative(name, params, data, temperature):
    s, t, targets = data
    values = per_token(name, s, t, targets, temperature, **params)
    assert values.shape == (s.shape[0],)
    assert np.all(values >= -1e-6), values


@pytest.mark.parametrize("name, params", [(n, {}) for n in ALL if n != "ce"] + [("jsd", {"beta": 0.8}),
                                                                                  ("lk", {"variant": "alpha"})])
@SETTINGS
@given(data=logit_pairs(), temperature=TEMPERATURES)
def test_zero_when_student_equals_teacher(name, params, data, temperature):
    _, t, _ = data  # topk_kl: default k=32 >= V, so its top-k is the whole distribution
    np.testing.assert_allclose(per_token(name, t, t, temperature=temperature, **params), 0.0, atol=1e-5)


@SETTINGS
@given(data=logit_pairs(), temperature=TEMPERATURES)
def test_matches_scipy_and_numpy(data, temperature):
    s, t, targets = data
    p, q = softmax(t, temperature), softmax(s, temperature)
    kw = dict(rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(per_token("fkl", s, t, temperature=temperature), entropy(p, q, axis=-1), **kw)
    np.testing.assert_allclose(per_token("rkl", s, t, temperature=temperature), entropy(q, p, axis=-1), **kw)
    np.testing.assert_allclose(per_token("tvd", s, t, temperature=temperature), 1 - np.minimum(p, q).sum(-1),
                               rtol=1e-4, atol=1e-6)
    # scipy takes sqrt of a rounding-negative value when p ~ q and returns nan there; the true value is 0
    np.testing.assert_allclose(per_token("jsd", s, t, temperature=temperature),
                               np.nan_to_num(jensenshannon(p, q, axis=-1), nan=0.0) ** 2, **kw)
    np.testing.assert_allclose(per_token("ce", s, t, targets, temperature),
                               -np.log(q[np.arange(len(targets)), targets]), **kw)


@SETTINGS
@given(data=logit_pairs(), beta=st.floats(0.05, 0.95))
def test_generalised_jsd_definition_symmetry_and_bound(data, beta):
    s, t, _ = data
    p, q = softmax(t), softmax(s)
    m = beta * p + (1 - beta) * q
    expected = beta * entropy(p, m, axis=-1) + (1 - beta) * entropy(q, m, axis=-1)
    got = per_token("jsd", s, t, beta=beta)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    # swapping student and teacher swaps the weights; at beta = 0.5 the divergence is symmetric
    np.testing.assert_allclose(got, per_token("jsd", t, s, beta=1 - beta), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(per_token("jsd", s, t), per_token("jsd", t, s), rtol=1e-4, atol=1e-6)
    # JSD_beta is the information a sample gives about a Bernoulli(beta) choice: at most its entropy
    assert np.all(got <= -(beta * math.log(beta) + (1 - beta) * math.log1p(-beta)) + 1e-6)
    assert np.all(per_token("jsd", s, t) <= math.log(2) + 1e-6)


@SETTINGS
@given(data=logit_pairs())
def test_pinsker_bounds_acceptance_rate(data):
    s, t, _ = data
    alpha = np.minimum(softmax(t), softmax(s)).sum(-1)  # expected acceptance rate of speculative sampling
    for name in ("fkl", "rkl"):
        kl = np.maximum(per_token(name, s, t), 0.0)
        # the loss computes KL in float32: near p = q it rounds a true 2 TV^2 ~ 5e-10 to 0 (hypothesis found logits
        # 6e-5 apart: TV 1.5e-5 against a bound of exactly 1); allow the loss's own rounding (~1e-6) inside the root
        assert np.all(alpha >= 1 - np.sqrt((kl + 1e-6) / 2) - 1e-6), name


# --- acceptance-targeted losses (LK) -------------------------------------------------------------------------


@SETTINGS
@given(data=logit_pairs(), temperature=TEMPERATURES)
def test_tvd_is_one_minus_acceptance_exactly(data, temperature):
    s, t, _ = data
    alpha = np.minimum(softmax(t, temperature), softmax(s, temperature)).sum(-1)
    np.testing.assert_allclose(per_token("tvd", s, t, temperature=temperature), 1 - alpha, atol=2e-6)
    np.testing.assert_allclose(per_token("lk", s, t, temperature=temperature, variant="alpha"), -np.log(alpha),
                               rtol=1e-4, atol=2e-6)


@SETTINGS
@given(data=logit_pairs(), eta=st.floats(0.0, 10.0))
def test_lk_lambda_mixes_kl_and_tv_by_the_mean_acceptance(data, eta):
    s, t, _ = data
    alpha = np.minimum(softmax(t), softmax(s)).sum(-1)
    lam = np.exp(-eta * alpha.mean())
    want = lam * per_token("fkl", s, t) + (1 - lam) * (1 - alpha)
    np.testing.assert_allclose(per_token("lk", s, t, eta=eta), want, rtol=1e-4, atol=1e-5)


@SETTINGS
@given(data=logit_pairs(max_abs=3.0))
@example(data=(np.zeros((1, 2), np.float32), np.array([[1e-6, 0.0]], np.float32), np.array([0])))
@example(data=(np.zeros((1, 2), np.float32), np.array([[1.1920929e-07, 0.0]], np.float32), np.array([0])))
def test_lk_alpha_gradient_is_tvds_over_alpha_and_raises_acceptance(data):
    """d(-log alpha) = d(TVD) / alpha per token (so low acceptance pushes harder), and a small step against it
    raises the acceptance rate."""
    s, t, _ = data
    teacher = Teacher(logits=torch.as_tensor(t))
    for row in range(len(s)):
        x = torch.as_tensor(s[row:row + 1]).double().requires_grad_(True)
        lk = build_loss("lk", variant="alpha").per_token(x, teacher.select(torch.tensor([row]))).sum()
        (g_lk,) = torch.autograd.grad(lk, x)
        tv = build_loss("tvd").per_token(x, teacher.select(torch.tensor([row]))).sum()
        (g_tv,) = torch.autograd.grad(tv, x)
        alpha = 1 - tv.item()
        # TVD has a kink where p = q: closer to it than float32 resolves probabilities (hypothesis found logits
        # 1.2e-7 apart: tv 3e-8), the two losses may take different subgradients, both valid
        assume(alpha > 1e-3 and g_tv.abs().max() > 1e-4 and tv.item() > 1e-7)
        torch.testing.assert_close(g_lk, g_tv / alpha, rtol=1e-3, atol=1e-6)
        # TVD is piecewise linear in the probabilities: a step longer than the distance to p = q overshoots the
        # kink (hypothesis found logits 1e-6 apart under a 1e-3 step), so the step scales with the distance
        step = min(1e-3, 0.1 * tv.item())
        after = np.minimum(softmax(t[row:row + 1]), softmax((x - step * g_lk / g_lk.norm()).detach().numpy())).sum()
        assert after >= alpha - 1e-6


# --- position weights (D-PACE) --------------------------------------------------------------------------------


@SETTINGS
@given(q=hnp.arrays(np.float64, (3, 4), elements=st.floats(0, 1)), ok=hnp.arrays(np.bool_, (3, 4)),
       alpha=st.floats(0.05, 1.0))
def test_dpace_weights_follow_their_definition(q, ok, alpha):
    """w_j = sum_{m >= j, valid} prod_{i <= m, valid} ((1 - alpha) q_i + alpha), positions along the last axis,
    0 where position j has no target; with alpha = 1 it counts the valid positions from j on."""
    got = dpace_weights([torch.as_tensor(q[:, j]).float() for j in range(4)],
                        [torch.as_tensor(ok[:, j]) for j in range(4)], alpha)
    got = torch.stack(got, -1).double().numpy()
    q_tilde = np.where(ok, (1 - alpha) * q + alpha, 1.0)
    reach = np.cumprod(q_tilde, -1) * ok
    want = np.flip(np.cumsum(np.flip(reach, -1), -1), -1) * ok
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    full = dpace_weights([torch.as_tensor(q[:, j]).float() for j in range(4)],
                         [torch.ones(3, dtype=torch.bool)] * 4, 1.0)
    assert [w.tolist() for w in full] == [[4.0] * 3, [3.0] * 3, [2.0] * 3, [1.0] * 3]
    all_valid = torch.stack(dpace_weights([torch.as_tensor(q[:, j]).float() for j in range(4)],
                                          [torch.ones(3, dtype=torch.bool)] * 4, alpha), -1)
    assert torch.all(all_valid[:, :-1] >= all_valid[:, 1:] - 1e-6)  # never increasing along the block


def test_dpace_alpha_range_and_weights_only_scale():
    with pytest.raises(LossError, match="alpha"):
        dpace_weights([torch.ones(2)], [torch.ones(2, dtype=torch.bool)], 0.0)
    s, t = torch.randn(4, 9, requires_grad=True), torch.randn(4, 9)
    w = torch.tensor([2.0, 0.5, 1.0, 0.0])
    loss = build_loss("fkl")
    weighted = loss(s, Teacher(t), weights=w)
    torch.testing.assert_close(weighted, (loss.per_token(s, Teacher(t)) * w).mean())
    kept = torch.tensor([True, False, True, True])
    torch.testing.assert_close(loss(s, Teacher(t), mask=kept, weights=w),
                               (loss.per_token(s, Teacher(t)) * w)[kept].mean())


# --- forward vs reverse KL ------------------------------------------------------------------------------------


def test_forward_kl_is_mass_covering_reverse_kl_mode_seeking():
    bimodal = np.log([[0.45, 0.45, 0.025, 0.025, 0.025, 0.025]])
    one_mode = np.log([[0.9, 1e-4, 0.025, 0.025, 0.025, 0.0249]])
    # q covers only one of p's modes: forward KL punishes the missed mode much more than reverse KL
    fkl, rkl = per_token("fkl", one_mode, bimodal), per_token("rkl", one_mode, bimodal)
    assert fkl[0] > 2 * rkl[0], (fkl, rkl)
    # mirror: q spreads over a second mode p lacks; now reverse KL is the larger
    unimodal = np.log([[0.9, 0.02, 0.02, 0.02, 0.02, 0.02]])
    fkl, rkl = per_token("fkl", bimodal, unimodal), per_token("rkl", bimodal, unimodal)
    assert rkl[0] > fkl[0], (fkl, rkl)


@SETTINGS
@given(data=logit_pairs())
def test_forward_kl_exceeds_reverse_when_student_misses_teacher_mass(data):
    _, t, _ = data
    s = t.copy()
    s[np.arange(len(t)), t.argmax(-1)] -= 50.0  # q almost 0 on the teacher's most likely token
    fkl, rkl = per_token("fkl", s, t), per_token("rkl", s, t)
    assert np.all(fkl > rkl), (fkl, rkl)


# --- reduction, gradients, temperature --------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
@SETTINGS
@given(data=logit_pairs(), keep=st.lists(st.booleans(), min_size=5, max_size=5))
def test_masked_out_tokens_do_not_change_the_loss(name, data, keep):
    s, t, targets = data
    mask = torch.tensor(keep[: len(s)])
    loss = build_loss(name)
    kept = mask.numpy()  # the kept rows alone (lk's lambda is their mean acceptance)
    ref = per_token(name, s[kept], t[kept], targets[kept]) if kept.any() else np.zeros(0)
    expected = ref.mean() if ref.size else 0.0
    s2, t2 = s.copy(), t.copy()  # garbage in the masked-out rows, NaN included
    s2[~mask.numpy()] = 1e4
    t2[~mask.numpy()] = np.nan
    got = loss(torch.as_tensor(s2), Teacher(torch.as_tensor(t2)), mask=mask, targets=torch.as_tensor(targets))
    assert got.dtype == torch.float32 and got.dim() == 0
    np.testing.assert_allclose(got.item(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ALL)
def test_gradient_reaches_student_only_and_empty_mask_is_zero(name):
    g = torch.Generator().manual_seed(0)
    s = torch.randn(4, 9, generator=g, requires_grad=True)
    t = torch.randn(4, 9, generator=g, requires_grad=True)
    targets = torch.tensor([0, 3, 5, 8])
    loss = build_loss(name)
    loss(s, Teacher(t), targets=targets).backward()
    assert s.grad is not None and s.grad.abs().sum() > 0
    assert t.grad is None
    s.grad = None
    empty = loss(s, Teacher(t), mask=torch.zeros(4, dtype=torch.bool), targets=targets)
    assert empty.item() == 0.0
    empty.backward()  # still part of the graph: a step with no kept token does not crash
    assert torch.all(s.grad == 0)


def test_bf16_student_gives_float32_loss():
    s = torch.randn(3, 7).bfloat16()
    assert build_loss("fkl").per_token(s, Teacher(torch.randn(3, 7))).dtype == torch.float32


def test_masked_mean():
    v = torch.tensor([1.0, 2.0, 6.0])
    assert masked_mean(v, None).item() == 3.0
    assert masked_mean(v, torch.tensor([True, False, True])).item() == 3.5
    assert masked_mean(v, torch.zeros(3, dtype=torch.bool)).item() == 0.0


@pytest.mark.parametrize("name", ALL)
@SETTINGS
@given(data=logit_pairs(), temperature=st.floats(0.25, 4.0))
def test_temperature_divides_both_sides(name, data, temperature):
    s, t, targets = data
    warm = per_token(name, s, t, targets, temperature)
    np.testing.assert_allclose(warm, per_token(name, s / temperature, t / temperature, targets), rtol=1e-4, atol=1e-6)


# --- stored top-k teacher -------------------------------------------------------------------------------------


@SETTINGS
@given(data=logit_pairs(), k=st.integers(1, 12), temperature=TEMPERATURES)
def test_fkl_from_stored_topk_is_kl_to_renormalised_topk(data, k, temperature):
    s, t, _ = data
    k = min(k, t.shape[1])
    teacher = stored_topk(t, k)
    ids = teacher.topk_ids.numpy()
    p = np.zeros(t.shape)  # reference: the dense p at T restricted to the stored ids, renormalised
    rows = np.arange(len(t))[:, None]
    p[rows, ids] = softmax(t, temperature)[rows, ids]
    p /= p.sum(-1, keepdims=True)
    dense = teacher.log_probs(temperature, t.shape[1])
    np.testing.assert_allclose(dense.exp().numpy(), p, rtol=1e-4, atol=1e-6)
    assert int(torch.isneginf(dense).sum()) == t.size - ids.size
    got = build_loss("fkl", temperature).per_token(torch.as_tensor(s), teacher).numpy()
    np.testing.assert_allclose(got, entropy(p, softmax(s, temperature), axis=-1), rtol=1e-4, atol=1e-6)


@SETTINGS
@given(data=logit_pairs(), k=st.integers(1, 6), temperature=TEMPERATURES)
def test_topk_kl_same_from_dense_and_stored(data, k, temperature):
    s, t, _ = data
    v = t.shape[1]
    k = min(k, v)
    ranked = -np.sort(-t, axis=-1)
    assume(k == v or np.all(ranked[:, k - 1] - ranked[:, k] > 1e-3))  # no tie at the top-k boundary
    loss = build_loss("topk_kl", temperature, k=k)
    dense = loss.per_token(torch.as_tensor(s), Teacher(torch.as_tensor(t))).numpy()
    stored = loss.per_token(torch.as_tensor(s), stored_topk(t, min(k + 2, v))).numpy()
    ids = np.argsort(-t, axis=-1, kind="stable")[:, :k]
    rows = np.arange(len(t))[:, None]
    pk = softmax(t[rows, ids], temperature)
    expected = (pk * (np.log(pk) - np.log(softmax(s, temperature)[rows, ids]))).sum(-1)
    np.testing.assert_allclose(dense, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(stored, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["rkl", "jsd", "tvd", "lk"])
def test_full_teacher_losses_reject_stored_topk(name):
    loss = build_loss(name)
    assert loss.needs_full_teacher
    t = torch.randn(2, 10)
    with pytest.raises(LossError, match=r"full teacher distribution.*distill\.teacher=live"):
        loss(torch.randn(2, 10), stored_topk(t.numpy(), 4))


def test_needs_full_teacher_flags():
    assert {n for n, cls in LOSSES.items() if cls.needs_full_teacher} == {"rkl", "jsd", "tvd", "lk"}
    assert set(LOSSES) == set(ALL)
    assert all(build_loss(n).name == n for n in ALL)


def test_topk_kl_k_beyond_stored_is_rejected():
    with pytest.raises(LossError, match="exceeds the 4 stored"):
        build_loss("topk_kl", k=5)(torch.randn(2, 10), stored_topk(np.random.randn(2, 10).astype(np.float32), 4))


def test_ce_ignores_teacher_and_needs_targets():
    s = torch.randn(2, 5)
    loss = build_loss("ce")
    assert torch.isfinite(loss(s, Teacher(), targets=torch.tensor([1, 2])))
    with pytest.raises(LossError, match="targets"):
        loss(s, Teacher())


# --- build_loss errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, kwargs, match", [
    ("kl", {}, "unknown loss 'kl'; known: fkl, rkl, jsd, tvd, topk_kl, ce, lk"),
    ("lk", {"variant": "beta"}, "variant must be one of"),
    ("lk", {"eta": -1.0}, "eta must"),
    ("jsd", {"beta": 0.0}, "beta"),
    ("jsd", {"beta": 1.0}, "beta"),
    ("fkl", {"temperature": 0.0}, "temperature"),
    ("fkl", {"temperature": -1.0}, "temperature"),
    ("topk_kl", {"k": 0}, "k must"),
    ("fkl", {"beta": 0.5}, "unknown parameter.*beta"),
    ("jsd", {"k": 3}, "unknown parameter.*k.*accepted: beta"),
])
def test_build_loss_errors(name, kwargs, match):
    with pytest.raises(LossError, match=match):
        build_loss(name, **kwargs)
