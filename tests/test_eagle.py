"""EAGLE heads: alignment, training-time test against drafting, lossless chain/static/dynamic trees, export."""

from __future__ import annotations

import pytest
import torch

from specdistill.core.models.vocab import target_to_draft
from specdistill.core.records import read_record
from specdistill.decoding.loop import speculative_generate
from specdistill.decoding.protocols import SamplingConfig
from specdistill.decoding.verifier import TargetVerifier
from specdistill.methods.eagle.model import (
    build_eagle,
    load_eagle,
    load_eagle3_layout,
    save_eagle,
)
from specdistill.methods.eagle.proposer import EagleProposer, EagleTreeConfig
from specdistill.methods.eagle.training import EagleModule, step_pairs, unroll
from specdistill.stages import train as train_stage
from specdistill.training.losses import build_loss

from .helpers.decoding import PROMPTS, plain_greedy, tree_paths
from .helpers.drafts import EAGLE_LAYERS, random_head, target_features
from .helpers.evaluate import eagle_eval_config, greedy_texts
from .helpers.models import make_model
from .helpers.train import composed, overrides

# --- alignment --------------------------------------------------------------------------------------

def test_step0_at_t_reads_h_t_and_x_t1_and_is_scored_at_t_plus_1(target, monkeypatch):
    T = 12
    ids = torch.arange(10, 10 + T)[None]
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[0, 4:T - 1] = True
    labels = torch.where(mask, torch.roll(ids, -1, dims=1), -100)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask, "labels": labels}
    head = random_head(target, "eagle3")
    module = EagleModule(target, head, ttt_steps=2, loss=build_loss("fkl"), optimizer=torch.optim.AdamW)
    seen = []
    advance = head.advance
    monkeypatch.setattr(head, "advance",
                        lambda h, tok, pos, m, c: seen.append((h, tok, pos)) or advance(h, tok, pos, m, c))
    with torch.no_grad():
        logits = target(input_ids=ids).logits[0]
        feats = target_features(target, ids, EAGLE_LAYERS["eagle3"])
        rows = list(module._steps(batch, 2, 0.0))
    h0, tok0, pos0 = seen[0]
    torch.testing.assert_close(h0, head.features_in(feats))  # anchor t reads h_t ...
    assert tok0[0, :T - 1].tolist() == ids[0, 1:].tolist() and pos0[0].tolist() == list(range(T))  # ... and x_{t+1}
    for s in rows:
        i = s.index
        expect = [t for t in range(T - i - 1) if mask[0, t + i + 1]]
        assert s.anchors[0].nonzero().flatten().tolist() == expect
        assert s.scored[0].nonzero().flatten().tolist() == [t + i + 1 for t in expect]
        for r, t in enumerate(expect):
            torch.testing.assert_close(s.teacher.logits[r], logits[t + i + 1].float())  # the target at t+i+1
            assert int(s.labels[r]) == 10 + t + i + 2  # which predicts x_{t+i+2}
    assert seen[1][1][0, 0] == ids[0, 2] and seen[1][2][0, 0] == 1  # step 1: x_{t+2}, position t+1


def test_step_pairs_stay_inside_the_rows():
    mask = torch.tensor([[0, 1, 1, 1, 0, 0]], dtype=torch.bool)
    anchors, scored = step_pairs(mask, 1)
    assert anchors[0].nonzero().flatten().tolist() == [0, 1] and scored[0].nonzero().flatten().tolist() == [2, 3]


def test_d2t_t2d_round_trip():
    d2t = torch.tensor([0, 3, 4, 9, 17])
    t2d = target_to_draft(d2t, 20)
    assert torch.equal(t2d[d2t], torch.arange(5)) and int((t2d >= 0).sum()) == 5


# --- training-time test equals drafting ---------------------------------------------------------------

@pytest.mark.parametrize("variant", ["eagle1", "eagle3", "eagle3.1"])
def test_unrolled_training_time_test_equals_step_by_step_drafting(target, variant):
    """Step i of the parallel unroll at anchor t = the proposer's cache-based drafting from the same
    committed context, fed the same tokens: masks, positions and state hand-over agree."""
    torch.manual_seed(0)
    head = random_head(target, variant, torch.arange(0, target.config.vocab_size, 3))
    ids = torch.randint(3, target.config.vocab_size, (1, 16))
    feats = target_features(target, ids, head.cfg.feature_layers)
    steps = 3
    with torch.no_grad():
        outs = unroll(head, feats, ids, torch.ones_like(ids), steps)
    for t in (0, 5, 11):
        proposer = EagleProposer(head, EagleTreeConfig(shape="chain", k=steps), capacity=64)
        context = ids[0, :t + 2].tolist()  # committed x_0..x_{t+1}; the anchor is t
        with torch.no_grad():
            proposer._catch_up(context, feats[0, :t + 1])
            torch.testing.assert_close(proposer.anchor_logits, head.logits(outs[0][0, t]), atol=1e-4, rtol=1e-4)
            state = proposer.anchor_out
            for i in range(1, steps):
                visible = torch.ones(1, t + 1 + i, dtype=torch.bool)
                state, logits = proposer._run(state[None], [int(ids[0, t + i + 1])], [t + i], visible)
                state = state[0]
                torch.testing.assert_close(logits[0], head.logits(outs[i][0, t]), atol=1e-4, rtol=1e-4)


# --- decoding ---------------------------------------------------------------------------------------

SHAPES = {"chain": EagleTreeConfig(shape="chain", k=4), "static": EagleTreeConfig(shape="static", branching=[3, 2, 1]),
          "dynamic": EagleTreeConfig(shape="dynamic", depth=4, top_k=3, total_tokens=10)}


@pytest.mark.parametrize("variant", ["eagle1", "eagle3", "eagle3.1"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_eagle_equals_plain_greedy(target, variant, shape):
    head = random_head(target, variant, torch.arange(0, target.config.vocab_size, 2) if variant != "eagle1" else None)
    proposer = EagleProposer(head, SHAPES[shape], capacity=128)
    ver = TargetVerifier(target, capacity=128, feature_layers=proposer.feature_layers)
    for prompt in PROMPTS:
        res = speculative_generate(ver, proposer, prompt, 24, stops=set())
        assert res.tokens == plain_greedy(target, prompt, 24), (prompt, shape)
        if shape == "dynamic":
            assert all(r.draft_len <= 10 for r in res.rounds)


def _path_logp(head, context, feats, path):
    """log q(next | committed context, path) by running the head along `path` alone (a chain: one node
    per call, causal attention over its ancestors), independently of the tree code's batching."""
    chain = EagleProposer(head, EagleTreeConfig(shape="chain", k=1), capacity=64)
    chain._catch_up(context, feats)
    state, logits = chain.anchor_out, chain.anchor_logits
    for i, tok in enumerate(path):
        out, lg = chain._run(state[None], [tok], [len(context) - 1 + i],
                             torch.ones(1, len(context) + i, dtype=torch.bool))
        state, logits = out[0], lg[0]
    return torch.log_softmax(chain._full(logits), -1)


@pytest.mark.parametrize("depth,top_k,total", [(3, 2, 10), (4, 3, 30), (4, 3, 10)])  # all kept, or trimmed
def test_dynamic_tree_is_eagle2s_selection(target, depth, top_k, total):
    """The batched tree (one head call and one top-k per level) keeps exactly the nodes EAGLE-2's rule
    picks when every node is scored on its own: children = the top_k tokens of each expanded node,
    expanded = the top_k nodes of a level by cumulative log-probability, kept = the best `total`.
    A wrong parent state, mask or position in the batched code changes the tree (lossless either way,
    so the greedy-equality tests cannot see it)."""
    head = random_head(target, "eagle3", torch.arange(0, target.config.vocab_size, 2))
    ids = torch.randint(3, target.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    feats = target_features(target, ids, EAGLE_LAYERS["eagle3"])[0]
    context = ids[0].tolist()
    with torch.no_grad():
        proposer = EagleProposer(head, EagleTreeConfig(shape="dynamic", depth=depth, top_k=top_k, total_tokens=total))
        tree = proposer.propose(context, depth, SamplingConfig(), None, feats[:-1])
        candidates, frontier = {}, [((), 0.0)]
        for _ in range(depth):
            level = {}
            for path, score in frontier:
                top = torch.topk(_path_logp(head, context, feats[:-1], list(path)), top_k)
                level.update({path + (t,): score + v
                              for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True)})
            candidates.update(level)
            frontier = sorted(level.items(), key=lambda kv: -kv[1])[:top_k]
    want = {path for path, _ in sorted(candidates.items(), key=lambda kv: -kv[1])[:total]}
    got = tree_paths(tree)
    assert len(tree) == total and got == want, (sorted(got), sorted(want))


def test_static_tree_is_every_nodes_top_children(target):
    """The static tree: every node's top-b_d children by its own head distribution, b_d per depth,
    checked against the head run along each path alone (as above)."""
    head = random_head(target, "eagle3", torch.arange(0, target.config.vocab_size, 2))
    ids = torch.randint(3, target.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    feats = target_features(target, ids, EAGLE_LAYERS["eagle3"])[0]
    context, branching = ids[0].tolist(), [3, 2, 2]
    with torch.no_grad():
        tree = EagleProposer(head, EagleTreeConfig(shape="static", branching=branching)).propose(
            context, 3, SamplingConfig(), None, feats[:-1])
        want, level = set(), [()]
        for b in branching:
            level = [path + (t,) for path in level
                     for t in torch.topk(_path_logp(head, context, feats[:-1], list(path)), b).indices.tolist()]
            want.update(level)
    assert len(tree) == 3 + 6 + 12 and tree_paths(tree) == want


def test_a_head_that_agrees_with_the_target_is_fully_accepted(tiny_tokenizer):
    """Not vacuous: a target whose greedy output is always token 0 (zero LM-head weights, a bias on 0)
    and an eagle1 head whose copy of the head scores every token 0 (argmax: token 0) agree at every
    depth, so every round accepts the whole chain: tau = 1 + k."""
    target = make_model(len(tiny_tokenizer), seed=0)
    head_layer = torch.nn.Linear(target.config.hidden_size, target.config.vocab_size, bias=True)
    with torch.no_grad():
        head_layer.weight.zero_()
        head_layer.bias.zero_()
        head_layer.bias[0] = 10.0
    target.lm_head = head_layer
    head = build_eagle(target, "eagle1", [2])  # copies the zero weights: its logits are all 0 -> argmax 0
    proposer = EagleProposer(head.eval(), EagleTreeConfig(shape="chain", k=3), capacity=128)
    ver = TargetVerifier(target, capacity=128, feature_layers=proposer.feature_layers)
    res = speculative_generate(ver, proposer, PROMPTS[0], 17, stops=set())
    assert res.tokens == [0] * 17 == plain_greedy(target, PROMPTS[0], 17)
    assert [r.accepted for r in res.rounds] == [3, 3, 3, 3] and res.tau == 17 / 5


def test_eagle31_flags_norm_each_fused_layer_and_carry_the_normed_state(target):
    """fc_norm: fc reads each fused layer normed on its own (scaling one layer's states changes nothing);
    norm_output: the state carried to the next step is the normed one the LM head reads."""
    head = random_head(target, "eagle3.1")
    ids = torch.randint(3, 300, (1, 6))
    feats = target_features(target, ids, EAGLE_LAYERS["eagle3"])
    h = target.config.hidden_size
    scaled = torch.cat([feats[..., :h] * 50, feats[..., h:]], dim=-1)
    with torch.no_grad():  # up to the norm's eps, which is not small beside the tiny model's states
        a, b = head.features_in(scaled), head.features_in(feats)
        assert (a - b).norm() / b.norm() < 0.02
        out = unroll(head, feats, ids, torch.ones_like(ids), 2)
        for state in out:  # RMSNorm's output over its weight has unit RMS
            torch.testing.assert_close((state / head.norm.weight).pow(2).mean(-1), torch.ones(1, 6),
                                       atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(head.logits(out[1]), head.lm_head(out[1]))
    with pytest.raises(ValueError, match="EAGLE-3.1"):
        build_eagle(target, "eagle1", EAGLE_LAYERS["eagle1"], fc_norm=True)


# --- saving, export, training -------------------------------------------------------------------------

def test_save_load_and_eagle3_export(tmp_path, target):
    d2t = torch.tensor([0, 2, 3, 7, 11, 40])
    head = random_head(target, "eagle3", d2t)
    head.cfg.target_fingerprint = "abc"
    save_eagle(head, tmp_path / "e")
    back = load_eagle(tmp_path / "e", target, target_fingerprint="abc")
    ids = torch.randint(3, 300, (1, 7))
    feats = target_features(target, ids, EAGLE_LAYERS["eagle3"])
    with torch.no_grad():
        a, b = unroll(head, feats, ids, torch.ones_like(ids), 2), unroll(back, feats, ids, torch.ones_like(ids), 2)
    torch.testing.assert_close(head.logits(a[1]), back.logits(b[1]))
    config, state = load_eagle3_layout(tmp_path / "e/eagle3")
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 6
    assert torch.equal(state["d2t"], d2t) and int(state["t2d"].sum()) == 6 and bool(state["t2d"][40])
    h = config["hidden_size"]
    assert state["fc.weight"].shape == (h, 3 * h) and state["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert state["lm_head.weight"].shape == (6, h) and not any("embed" in k for k in state)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # not the default: named
    with pytest.raises(ValueError, match="retrain"):
        load_eagle(tmp_path / "e", target, target_fingerprint="other")


@pytest.mark.parametrize(("method", "loss", "vocab"), [("eagle", "fkl", "128"), ("eagle", "jsd", "null"),
                                                       ("eagle1", "fkl", "128"), ("eagle", "ce", "128"),
                                                       ("eagle3.1", "fkl", "128"), ("eagle-dpace", "fkl", "128")])
def test_fast_dev_run_eagle(tmp_path, tiny_target_dir, generated, method, loss, vocab):
    flags = {"eagle3.1": ["methods.eagle.fc_norm=true", "methods.eagle.norm_output=true"],
             "eagle-dpace": ["methods.eagle.step_weights=dpace"]}.get(method, [])
    method = "eagle" if flags else method
    layers = "[2]" if method == "eagle1" else "[0,1,2]"
    cfg = composed(*overrides(tmp_path, tiny_target_dir, generated, f"method={method}", f"loss={loss}",
                              "+trainer.fast_dev_run=2", f"methods.{method}.vocab_size={vocab}",
                              f"methods.{method}.feature_layers={layers}", *flags))
    res = train_stage.run(cfg)
    final = res["final"]
    assert 0 < final["val/alpha"] <= 1 and 1 <= final["val/tau_sim"] <= 5 and "val/alpha_pos3_t0" in final
    assert ("val/vocab_coverage" in final) == (vocab == "128")
    from transformers import AutoModelForCausalLM

    head = load_eagle(tmp_path / f"models/{method}", AutoModelForCausalLM.from_pretrained(tiny_target_dir))
    assert head.cfg.variant == ("eagle1" if method == "eagle1" else "eagle3")
    v31 = "methods.eagle.fc_norm=true" in flags
    assert head.cfg.fc_norm == head.cfg.norm_output == v31 and (head.fc_norm is not None) == v31
    assert (tmp_path / f"models/{method}/eagle3/config.json").exists() == (method == "eagle")
    assert read_record(tmp_path / f"metrics/train_{method}.json")["settings"]["method"]["variant"]


def test_evaluate_stage_runs_eagle(tmp_path, tiny_target_dir, monkeypatch):
    from specdistill.core.errors import ConfigError
    from specdistill.stages import evaluate as evaluate_stage
    cfg = eagle_eval_config(tmp_path, tiny_target_dir, monkeypatch)
    metrics = evaluate_stage.run(cfg)
    assert {"ar", "spec"} <= set(metrics["results"]["mtbench"]["T0"])
    assert metrics["settings"]["eagle_variant"] == "eagle3" and metrics["settings"]["eagle_tree"]["total_tokens"] == 5
    t0 = greedy_texts(tmp_path / "plots/eagle/samples.jsonl")
    assert t0[(1, "spec")] == t0[(1, "ar")] and t0[(2, "spec")] == t0[(2, "ar")]
    cfg["decode"]["eagle"]["tree"] = {"shape": "bush"}
    with pytest.raises(ConfigError, match=r"decode.eagle.tree"):
        evaluate_stage.run(cfg)
    # depth 2, top_k 2 grows 2 + 4 nodes: asking to keep 16 would verify 6 under a 16-node label
    cfg["decode"]["eagle"]["tree"] = {"shape": "dynamic", "depth": 2, "top_k": 2, "total_tokens": 16}
    with pytest.raises(ConfigError, match="grows at most 6 nodes, not total_tokens=16"):
        evaluate_stage.run(cfg)
