"""The GPU path: the same decoding, training and evaluation code on CUDA, with tiny random models.

CI has no GPU, so the module skips there; run it on a GPU machine with `pytest tests/test_gpu.py`.
What it catches is what only a GPU shows: a tensor or a torch.Generator left on the CPU beside CUDA
tensors, bf16-mixed training, HF generation on the device. `SPECDISTILL_TEST_DEVICE=cpu` runs it on
the CPU to check the module itself.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from specdistill.decoding.loop import speculative_generate
from specdistill.decoding.protocols import SamplingConfig
from specdistill.decoding.union import UnionProposer
from specdistill.decoding.verifier import TargetVerifier
from specdistill.methods.draft.proposer import DraftLMProposer
from specdistill.methods.eagle.proposer import EagleProposer, EagleTreeConfig
from specdistill.methods.lookup.proposer import PromptLookupProposer
from specdistill.methods.medusa.proposer import MedusaProposer
from specdistill.methods.medusa.tree import grow_tree
from specdistill.stages import train as train_stage

from .helpers.data import save_mtbench
from .helpers.decoding import PROMPTS
from .helpers.drafts import random_head, random_heads
from .helpers.models import make_model
from .helpers.stats import chi2_p
from .helpers.train import composed, overrides

DEVICE = os.environ.get("SPECDISTILL_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def target(tiny_tokenizer):
    return make_model(len(tiny_tokenizer), seed=0).to(DEVICE)


def greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt], device=DEVICE), do_sample=False, max_new_tokens=n,
                         pad_token_id=2, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def proposers(target):
    v = target.config.vocab_size
    draft = make_model(v, seed=123, layers=1).to(DEVICE)
    half = torch.arange(0, v, 2)
    medusa = random_heads(target.cpu(), 3, half).to(DEVICE)
    eagle3 = random_head(target.cpu(), "eagle3", half).to(DEVICE)
    eagle1 = random_head(target.cpu(), "eagle1").to(DEVICE)
    target.to(DEVICE)
    dynamic = EagleTreeConfig(shape="dynamic", depth=4, top_k=3, total_tokens=10)
    return {
        "draft-chain": DraftLMProposer(draft, k=4),
        "draft-tree": DraftLMProposer(draft, branching=[2, 2, 1]),
        "lookup": PromptLookupProposer(k=4),
        "medusa": MedusaProposer(medusa, grow_tree([[0.5, 0.2, 0.1]] * 3, 10)),
        "eagle3-chain": EagleProposer(eagle3, EagleTreeConfig(shape="chain", k=4), capacity=128),
        "eagle3-static": EagleProposer(eagle3, EagleTreeConfig(shape="static", branching=[3, 2, 1]), capacity=128),
        "eagle3-dynamic": EagleProposer(eagle3, dynamic, capacity=128),
        "eagle1-dynamic": EagleProposer(eagle1, dynamic, capacity=128),
        "eagle3+lookup": UnionProposer(EagleProposer(eagle3, dynamic, capacity=128),
                                       PromptLookupProposer(k=4, min_ngram=1)),
    }


def test_every_proposer_is_greedy_lossless_on_the_device(target):
    for name, proposer in proposers(target).items():
        ver = TargetVerifier(target, capacity=128, feature_layers=getattr(proposer, "feature_layers", ()))
        for prompt in PROMPTS:
            res = speculative_generate(ver, proposer, prompt, 24, stops=set())
            assert res.tokens == greedy(target, prompt, 24), (name, prompt)


@pytest.mark.parametrize("name", ["draft-tree", "eagle3-dynamic", "eagle3+lookup"])
def test_sampling_at_temperature_one_follows_the_target_on_the_device(target, name):
    """The first two tokens' exact marginals come from the target itself (one batched forward over every
    first token); a CPU generator drives the sampler on the device, as the evaluate stage's does."""
    prompt = PROMPTS[0]
    with torch.no_grad():
        first = torch.softmax(target(torch.tensor([prompt], device=DEVICE)).logits[0, -1].double(), -1)
        v = first.shape[0]
        rows = torch.cat([torch.tensor(prompt, device=DEVICE).expand(v, -1),
                          torch.arange(v, device=DEVICE)[:, None]], 1)
        second = first @ torch.softmax(target(rows).logits[:, -1].double(), -1)
    proposer = proposers(target)[name]
    ver = TargetVerifier(target, capacity=64, feature_layers=getattr(proposer, "feature_layers", ()))
    g = torch.Generator().manual_seed(0)
    draws = np.array([speculative_generate(ver, proposer, prompt, 2, set(), SamplingConfig(1.0), g).tokens
                      for _ in range(3000)])
    for pos, probs in ((0, first), (1, second)):
        assert chi2_p(draws[:, pos], probs, min_expected=5.0) > 1e-3, (name, pos)


@pytest.mark.parametrize("method", ["draft", "medusa", "eagle", "eagle1"])
def test_train_fast_dev_run_bf16_mixed_on_the_device(tmp_path, tiny_target_dir, generated, method):
    extra = {"draft": [], "medusa": ["methods.medusa.num_heads=3", "methods.medusa.tree_budgets=[4]"],
             "eagle": ["methods.eagle.feature_layers=[0,1,2]"], "eagle1": ["methods.eagle1.feature_layers=[2]"]}[method]
    extra.append(f"methods.{method}.vocab_size=128")
    ovr = [o for o in overrides(tmp_path, tiny_target_dir, generated)
           if not o.startswith(("target.device=", "trainer.precision=", "target.dtype="))]
    gpu = DEVICE == "cuda"
    ovr += [f"method={method}", "+trainer.fast_dev_run=2", f"target.device={DEVICE}",
            "target.dtype=" + ("bfloat16" if gpu else "float32"), *extra]
    ovr += ["trainer=gpu", "trainer.enable_progress_bar=false"] if gpu else ["trainer.precision=32-true"]
    res = train_stage.run(composed(*ovr))
    assert 0 < res["final"]["val/alpha"] <= 1 and np.isfinite(res["final"]["val/loss"])
    assert (tmp_path / f"metrics/train_{method}.json").exists()


@pytest.mark.parametrize("method", ["draft", "eagle"])
def test_evaluate_stage_on_the_device(tmp_path, tiny_target_dir, monkeypatch, method):
    from specdistill.core.models.target import TargetConfig, load_target
    from specdistill.methods.eagle.model import save_eagle
    from specdistill.stages import evaluate as evaluate_stage
    save_mtbench(tmp_path / "prompts")
    ev = {"method": method, "datasets": ["mtbench"], "num_prompts": 1, "max_new_tokens": 8, "temperatures": [0.0, 1.0]}
    if method == "eagle":
        loaded = load_target(TargetConfig(name_or_path=str(tiny_target_dir), dtype="float32"))
        head = random_head(loaded.model, "eagle3", torch.arange(100))
        head.cfg.target_fingerprint = loaded.fingerprint
        save_eagle(head, tmp_path / "models/eagle")
        ev |= {"decode": {"path": str(tmp_path / "models/eagle")}, "hf_baselines": False}
    else:
        ev |= {"decode": {"path": None, "layers": 1}, "k": 3, "hf_baselines": True}
    monkeypatch.chdir(tmp_path)
    cfg = {"paths": {"prompts_dir": str(tmp_path / "prompts")}, "logger": {"enabled": False},
           "target": {"name_or_path": str(tiny_target_dir), "dtype": "float32", "device": DEVICE}, "eval": ev}
    metrics = evaluate_stage.run(cfg)
    assert {"ar", "spec"} <= set(metrics["results"]["mtbench"]["T0"])
    samples = [json.loads(x) for x in (tmp_path / f"plots/{method}/samples.jsonl").read_text().splitlines()]
    t0 = {(s["turn"], s["method"]): s["text"] for s in samples if s["temperature"] == 0.0}
    assert t0[(1, "spec")] == t0[(1, "ar")] and t0[(2, "spec")] == t0[(2, "ar")]
    assert {(s["turn"], s["method"]) for s in samples if s["temperature"] == 1.0} >= {(1, "spec"), (2, "spec")}


def test_online_stage_on_the_device(tmp_path, tiny_target_dir, tiny_tokenizer, monkeypatch):
    """Serving and the student's updates run beside the target on its device."""
    from specdistill.core.models.target import TargetConfig, load_target
    from specdistill.methods.draft.model import save_draft
    from specdistill.stages import online as online_stage

    from .helpers.data import save_code_prompts
    from .helpers.drafts import student

    save_code_prompts(tiny_tokenizer, tmp_path / "prompts/humaneval")
    save_draft(student(load_target(TargetConfig(name_or_path=str(tiny_target_dir), dtype="float32")).model),
               tmp_path / "models/draft")
    monkeypatch.chdir(tmp_path)
    cfg = {"paths": {"prompts_dir": str(tmp_path / "prompts"), "models_dir": str(tmp_path / "models"),
                     "metrics_dir": str(tmp_path / "metrics"), "plots_dir": str(tmp_path / "plots")},
           "logger": {"enabled": False},
           "target": {"name_or_path": str(tiny_target_dir), "dtype": "float32", "device": DEVICE},
           "online": {"requests": 4, "held_out": 2, "max_new_tokens": 12, "update_every": 2, "steps": 2,
                      "batch_size": 2, "topk": 16, "lr": 1e-3, "scenario": "code"}}
    metrics = online_stage.run(cfg)
    assert len(metrics["updates"]) >= 1 and metrics["time"]["update_s"] > 0
    assert (tmp_path / "models/online_draft/final/config.json").exists()
