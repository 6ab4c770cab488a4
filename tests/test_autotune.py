"""eval.depth=auto: the prediction from measured costs and a pilot, the cap, and the evaluate stage's choice."""

from __future__ import annotations

import pytest

from specdistill.decoding.loop import speculative_generate
from specdistill.decoding.proposers import DraftLMProposer
from specdistill.decoding.protocols import SamplingConfig
from specdistill.decoding.verifier import TargetVerifier
from specdistill.errors import ConfigError
from specdistill.evaluation.autotune import DepthCapped, Pilot, chain_tree, predict, verify_seconds
from specdistill.records import read_record
from specdistill.stages import evaluate as evaluate_stage

from .helpers.models import make_model


def pilot(accepted, draft_s, nodes):
    p = Pilot()
    p.accepted, p.draft_s, p.nodes = list(accepted), [draft_s] * len(accepted), [nodes] * len(accepted)
    return p


def test_tau_is_one_plus_the_chained_acceptance_and_the_cost_is_draft_plus_verification():
    deep = pilot([0, 1, 2, 3], draft_s=0.3, nodes=3)  # a chain of 3: rounds accepting 0, 1, 2 and 3 tokens
    shallow = pilot([0, 1], draft_s=0.1, nodes=1)
    verify = {0: 1.0, 1: 1.0, 2: 1.1, 3: 1.2}
    p = predict(deep, shallow, 3, verify)
    # P(A >= 1) = 3/4, P(A >= 2) = 2/4, P(A >= 3) = 1/4: tau(1) = 1.75, tau(2) = 2.25, tau(3) = 2.5
    assert [round(p[d]["tau"], 6) for d in range(4)] == [1.0, 1.75, 2.25, 2.5]
    # draft seconds linear in depth between the pilots (0.1 at 1, 0.3 at 3), nodes likewise
    assert p[2]["nodes"] == 2 and p[2]["round_s"] == pytest.approx(0.2 + 1.1)
    assert p[3]["speedup"] == pytest.approx(2.5 * 1.0 / (0.3 + 1.2)) and p[0]["speedup"] == 1.0


def test_cheap_verification_chooses_deep_and_costly_verification_chooses_plain_ar():
    deep, shallow = pilot([0, 1, 2, 3, 3, 2], 0.02, 3), pilot([0, 1, 1], 0.01, 1)
    fast = predict(deep, shallow, 3, {0: 1.0, 1: 1.0, 3: 1.02})  # a native-bf16 CPU: verifying 3 nodes ~ free
    assert max(fast, key=lambda d: fast[d]["speedup"]) == 3
    weak = pilot([0, 0, 0, 1, 0, 0], 0.3, 3)  # a weak draft on a CPU where every node costs (AVX2, bf16 emulated)
    slow = predict(weak, pilot([0, 0, 1], 0.1, 1), 3, {0: 1.0, 1: 1.9, 3: 3.5})
    assert max(slow, key=lambda d: slow[d]["speedup"]) == 0 and all(slow[d]["speedup"] < 1 for d in (1, 2, 3))


def test_the_pilot_must_have_run():
    with pytest.raises(ValueError, match="no round"):
        predict(Pilot(), Pilot(), 2, {0: 1.0})


def test_a_capped_draft_stays_lossless_and_depth_zero_is_ar(tiny_tokenizer):
    target, draft = make_model(len(tiny_tokenizer), seed=0), make_model(len(tiny_tokenizer), seed=1)
    prompt, stops = [5, 6, 7, 8], {tiny_tokenizer.eos_token_id}
    ar = speculative_generate(TargetVerifier(target, 256), None, prompt, 16, stops)
    for depth in (0, 1, 2):
        res = speculative_generate(TargetVerifier(target, 256), DepthCapped(DraftLMProposer(draft, k=4), depth),
                                   prompt, 16, stops, SamplingConfig())
        assert res.tokens == ar.tokens  # greedy: the target's own chain at every cap
        assert max((r.draft_depth for r in res.rounds), default=0) <= depth
        assert depth or not any(r.draft_len for r in res.rounds)


def test_verification_seconds_are_measured_per_node_count(tiny_model):
    out = verify_seconds(TargetVerifier(tiny_model, 256), list(range(3, 40)), [0, 1, 4], vocab=100, repeats=2)
    assert set(out) == {0, 1, 4} and all(s > 0 for s in out.values())
    assert chain_tree(3, 100).parents.tolist() == [-1, 0, 1]


def test_the_evaluate_stage_chooses_the_depth_it_predicts_best_on_dev_prompts(tmp_path, tiny_target_dir, monkeypatch):
    from specdistill.stages.prepare import save_split

    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": t}], "source": "mtbench", "category": "x",
             "reference": "", "turns": [t], "prompt": "", "prompt_tokens": 1}
            for i, t in enumerate(["Write a poem.", "What is Paris?", "Name a colour."])]
    save_split(rows, tmp_path / "prompts/mtbench")
    monkeypatch.chdir(tmp_path)
    cfg = {"paths": {"prompts_dir": str(tmp_path / "prompts")}, "logger": {"enabled": False},
           "target": {"name_or_path": str(tiny_target_dir), "dtype": "float32"},
           "decode": {"draft": {"path": None, "layers": 1}},
           "eval": {"method": "draft", "k": 3, "datasets": ["mtbench"],
                    "num_prompts": 2, "max_new_tokens": 8, "temperatures": [0.0, 1.0], "hf_baselines": False,
                    "depth": "auto"}}
    metrics = evaluate_stage.run(cfg)
    auto = read_record(tmp_path / "metrics/draft.json")["settings"]["auto_depth"]
    pred = {int(d): p["speedup"] for d, p in auto["predicted"].items()}
    assert sorted(pred) == [0, 1, 2, 3] and auto["depth"] == max(pred, key=pred.get)
    assert auto["pilot_prompts"] == 1 and auto["verify_s"]["0"] > 0 and auto["pilot_rounds"] > 0
    m = metrics["results"]["mtbench"]["T0"]["spec"]
    assert all(f"alpha_pos{k}" not in m for k in range(auto["depth"] + 1, 5))  # nothing drafted past the cap
    cfg["eval"]["depth"] = "deep"
    with pytest.raises(ConfigError, match="eval.depth='deep'"):
        evaluate_stage.run(cfg)
