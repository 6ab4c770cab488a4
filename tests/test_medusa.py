"""Medusa heads: alignment of heads and targets, trees, lossless decoding, train@medusa end to end."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from specdistill.decoding.loop import speculative_generate
from specdistill.decoding.protocols import SamplingConfig
from specdistill.decoding.tree import DraftTree
from specdistill.decoding.verifier import TargetVerifier
from specdistill.methods.medusa.model import load_medusa, save_medusa
from specdistill.methods.medusa.proposer import MedusaProposer
from specdistill.methods.medusa.training import MedusaModule, head_pairs
from specdistill.methods.medusa.tree import cartesian_choices, check_choices, expected_accepted, grow_tree
from specdistill.stages import train as train_stage
from specdistill.training.losses import build_loss

from .helpers.data import save_mtbench
from .helpers.decoding import PROMPTS, plain_greedy
from .helpers.drafts import random_heads
from .helpers.train import composed, overrides

# --- alignment --------------------------------------------------------------------------------------

def test_head_k_at_t_reads_h_t_and_is_scored_at_t_plus_k(target):
    """A constructed sequence whose token at t is 10 + t: labels name their position, so any shift shows."""
    T, K = 14, 3
    ids = torch.stack([torch.arange(10, 10 + T), torch.arange(10, 10 + T)])
    mask = torch.zeros(2, T, dtype=torch.bool)
    mask[0, 4:T - 1] = True  # prompt of 5 tokens: positions 4..12 predict response tokens
    mask[1, 2:9] = True  # a shorter answer, then padding
    labels = torch.where(mask, torch.roll(ids, -1, dims=1), -100)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask, "labels": labels}
    module = MedusaModule(target, random_heads(target, K), loss=build_loss("fkl"), optimizer=torch.optim.AdamW)
    with torch.no_grad():
        hidden = target.get_decoder()(input_ids=ids).last_hidden_state
        logits = target.get_output_embeddings()(hidden)
    seen = 0
    for k, h, t_logits, y in module.head_batches(batch):
        expect = [(b, t) for b in range(2) for t in range(T - k) if mask[b, t] and mask[b, t + k]]
        assert len(h) == len(expect) > 0
        for row, (b, t) in enumerate(expect):
            torch.testing.assert_close(h[row], hidden[b, t])
            torch.testing.assert_close(t_logits[row], logits[b, t + k].float())  # the target's view of x_{t+k+1}
            assert int(y[row]) == 10 + t + k + 1  # the token k+1 steps after t
        seen += 1
    assert seen == K


def test_head_pairs_never_cross_rows_or_leave_the_mask():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 1, 1]], dtype=torch.bool)
    src, dst = head_pairs(mask, 1)
    assert src.tolist() == [[False, True, True, False, False], [True, False, False, True, False]]
    assert dst.tolist() == [[False, False, True, True, False], [False, True, False, False, True]]
    src, dst = head_pairs(mask, 5)
    assert not src.any() and not dst.any()


# --- trees ------------------------------------------------------------------------------------------

def prefix_closed_subsets(universe, size):
    for subset in itertools.combinations(universe, size):
        s = set(subset)
        if all(len(c) == 1 or c[:-1] in s for c in subset):
            yield subset


def test_grown_tree_is_a_valid_prefix_tree_and_the_best_of_its_size():
    g = torch.Generator().manual_seed(3)
    acc = torch.rand(3, 3, generator=g).sort(descending=True).values * 0.5  # per-rank accuracy, sums < 1.5
    acc = (acc / acc.sum(1, keepdim=True).clamp(min=1)).tolist()
    universe = cartesian_choices(3, 3)
    for budget in (1, 2, 4, 6):
        tree = grow_tree(acc, budget)
        assert len(tree) == budget
        check_choices(tree, 3, 3)
        assert tree == sorted(tree, key=lambda c: (len(c), c))
        best = max(expected_accepted(s, acc) for s in prefix_closed_subsets(universe, budget))
        assert expected_accepted(tree, acc) == pytest.approx(best)


def test_cartesian_tree_of_three_heads_top3():
    """Exercise 3: 3 heads with top-3 each give 3^3 = 27 candidate sequences and 3 + 9 + 27 = 39 tree tokens."""
    tree = cartesian_choices(3, 3)
    leaves = [c for c in tree if len(c) == 3]
    assert len(leaves) == 27 and len(tree) == 39


def test_invalid_choices_are_refused():
    with pytest.raises(ValueError, match="parent"):
        check_choices([(0,), (1, 0)], 3)
    with pytest.raises(ValueError, match="depth"):
        check_choices([(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)], 3)


# --- decoding ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("reduced", [False, True])
def test_greedy_medusa_equals_plain_greedy(target, reduced):
    d2t = torch.arange(0, target.config.vocab_size, 2) if reduced else None
    heads = random_heads(target, 3, d2t)
    proposer = MedusaProposer(heads, grow_tree([[0.5, 0.2, 0.1]] * 3, 10))
    ver = TargetVerifier(target, capacity=128, feature_layers=proposer.feature_layers)
    accepted = 0
    for prompt in PROMPTS:
        res = speculative_generate(ver, proposer, prompt, 24, stops=set())
        assert res.tokens == plain_greedy(target, prompt, 24), prompt
        assert all(r.draft_len == 10 or r.draft_depth < 3 for r in res.rounds)
        accepted += sum(r.accepted for r in res.rounds)
    assert accepted > 0  # not vacuous: drafts were accepted, and the output still matches


def test_medusa_tree_shape_from_choices(target):
    heads = random_heads(target, 2)
    proposer = MedusaProposer(heads, [(0,), (1,), (0, 0), (0, 1), (1, 0)])
    proposer.hidden = torch.randn(target.config.hidden_size)
    tree = proposer.propose([1, 2], 8, SamplingConfig(), None)
    assert isinstance(tree, DraftTree) and tree.parents.tolist() == [-1, -1, 0, 0, 1]
    top = heads(proposer.hidden).topk(2, dim=-1).indices
    assert tree.tokens.tolist() == [top[0, 0], top[0, 1], top[1, 0], top[1, 1], top[1, 0]]


def test_medusa_proposer_runs_only_the_heads_within_max_depth(target):
    heads = random_heads(target, 3)
    proposer = MedusaProposer(heads, [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    proposer.hidden = torch.randn(target.config.hidden_size)
    calls = []
    for k, h in enumerate(heads.heads, start=1):
        h.register_forward_hook(lambda *_, k=k: calls.append(k))
    full = proposer.propose([1, 2], 8, SamplingConfig(), None)
    calls.clear()
    cut = proposer.propose([1, 2], 1, SamplingConfig(), None)
    assert calls == [1]  # heads 2 and 3 are not computed when only depth 1 fits
    assert cut.parents.tolist() == [-1, -1] and cut.tokens.tolist() == full.tokens[:2].tolist()


# --- saving and training ----------------------------------------------------------------------------

def test_save_load_round_trip_and_target_check(tmp_path, target):
    heads = random_heads(target, 2, torch.arange(50))
    heads.cfg.target_fingerprint = "abc"
    save_medusa(heads, tmp_path / "m", trees={"trees": {}})
    back = load_medusa(tmp_path / "m", target_fingerprint="abc")
    h = torch.randn(3, target.config.hidden_size)
    torch.testing.assert_close(back(h), heads(h))
    assert torch.equal(back.d2t, torch.arange(50))
    with pytest.raises(ValueError, match="retrain"):
        load_medusa(tmp_path / "m", target_fingerprint="other")


@pytest.mark.parametrize(("loss", "vocab"), [("fkl", "128"), ("jsd", "null"), ("ce", "128"), ("tvd", "128")])
def test_fast_dev_run_medusa(tmp_path, tiny_target_dir, generated, loss, vocab):
    cfg = composed(*overrides(tmp_path, tiny_target_dir, generated, "method=medusa", f"loss={loss}",
                              "+trainer.fast_dev_run=2", f"methods.medusa.vocab_size={vocab}",
                              "methods.medusa.num_heads=3", "methods.medusa.tree_budgets=[4,8]"))
    res = train_stage.run(cfg)
    final = res["final"]
    for k in (1, 2, 3):
        assert 0 <= final[f"val/head{k}_top1"] <= final[f"val/head{k}_top5"] <= 1
        assert 0 < final[f"val/head{k}_alpha"] <= 1
    assert final["val/alpha"] == final["val/head1_alpha"] and final["val/tau_tree8"] >= final["val/tau_tree4"] >= 1
    saved = json.loads((tmp_path / "models/medusa/tree.json").read_text())
    for b in ("4", "8"):
        choices = [tuple(c) for c in saved["trees"][b]["choices"]]
        assert len(choices) == int(b)
        check_choices(choices, 3, 10)
    heads = load_medusa(tmp_path / "models/medusa")
    assert heads.num_heads == 3 and (heads.d2t is None) == (vocab == "null")
    assert (tmp_path / "metrics/train_medusa.json").exists()
    assert "head1_top1" in (tmp_path / "plots/train_medusa/val.csv").read_text().splitlines()[0]


def test_medusa_refuses_a_stored_teacher(tmp_path, tiny_target_dir, generated):
    from specdistill.core.errors import ConfigError

    with pytest.raises(ConfigError, match="teacher=live"):
        train_stage.run(composed(*overrides(tmp_path, tiny_target_dir, generated, "method=medusa",
                                            "distill.teacher=stored", "loss=fkl")))


def test_evaluate_stage_runs_medusa(tmp_path, tiny_target_dir, tiny_tokenizer, monkeypatch):
    from specdistill.core.models.target import TargetConfig, load_target
    from specdistill.stages import evaluate as evaluate_stage
    save_mtbench(tmp_path / "prompts")
    loaded = load_target(TargetConfig(name_or_path=str(tiny_target_dir), dtype="float32"))
    heads = random_heads(loaded.model, 3, torch.arange(100))
    heads.cfg.target_fingerprint = loaded.fingerprint
    save_medusa(heads, tmp_path / "models/medusa", trees={"trees": {"4": {"choices": [[0], [1], [0, 0], [0, 0, 0]]}}})
    monkeypatch.chdir(tmp_path)
    cfg = {"paths": {"prompts_dir": str(tmp_path / "prompts")}, "logger": {"enabled": False},
           "target": {"name_or_path": str(tiny_target_dir), "dtype": "float32"},
           "eval": {"method": "medusa", "datasets": ["mtbench"], "num_prompts": 1, "max_new_tokens": 8,
                    "temperatures": [0.0, 1.0]},
           "decode": {"medusa": {"path": str(tmp_path / "models/medusa"), "budget": 4}}}
    metrics = evaluate_stage.run(cfg)
    m = metrics["results"]["mtbench"]["T0"]
    assert {"ar", "spec"} <= set(m) and metrics["settings"]["tree_nodes"] == 4
    assert metrics["settings"]["draft_parameters"] == sum(p.numel() for p in heads.parameters())
    samples = [json.loads(x) for x in (tmp_path / "plots/medusa/samples.jsonl").read_text().splitlines()]
    t0 = {(s["turn"], s["method"]): s["text"] for s in samples if s["temperature"] == 0.0}
    assert t0[(1, "spec")] == t0[(1, "ar")] and t0[(2, "spec")] == t0[(2, "ar")]  # lossless at T=0, both turns
    cfg["decode"]["medusa"]["budget"] = 16  # not saved, and no accuracies to grow it from
    with pytest.raises(ValueError, match=r"decode.medusa.budget=16"):
        evaluate_stage.run(cfg)
    trees = json.loads((tmp_path / "models/medusa/tree.json").read_text())
    trees["acc"] = [[0.5, 0.2], [0.4, 0.1], [0.3, 0.1]]
    (tmp_path / "models/medusa/tree.json").write_text(json.dumps(trees))
    cfg["decode"]["medusa"]["budget"] = 5  # grown from the saved accuracies
    assert evaluate_stage.run(cfg)["settings"]["tree_nodes"] == 5


def test_heads_without_a_fingerprint_for_another_width_are_refused(tmp_path, target):
    """Issue 33, item 5: heads of a 128-wide target, saved without a fingerprint, once crashed in a matmul."""
    from transformers import LlamaConfig, LlamaForCausalLM

    wide = LlamaForCausalLM(LlamaConfig(vocab_size=target.config.vocab_size, hidden_size=128, intermediate_size=128,
                                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    heads = random_heads(wide, 2, None)
    assert heads.cfg.target_fingerprint is None
    save_medusa(heads, tmp_path / "m", trees={"trees": {}})
    with pytest.raises(ValueError, match=r"width 128 .*this target has 64 .*train@medusa"):
        load_medusa(tmp_path / "m", target=target)
    weights = tmp_path / "m" / "medusa.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a damaged header
    with pytest.raises(ValueError, match=r"not a readable safetensors file .*retrain"):
        load_medusa(tmp_path / "m", target=wide)
