"""The generate stage on a tiny random Llama: contract, greedy equivalence, determinism, resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import datasets
import pytest
import torch

from specdistill.core.data.generation import GenerateConfig, generate_shard, shard_name
from specdistill.core.data.prompts import apply_template
from specdistill.core.models.target import stop_ids
from specdistill.core.records import read_record
from specdistill.stages import generate as generate_stage

from .helpers.generation import QUESTIONS, make_prompts, read_split, stage_cfg
from .helpers.project import ROOT


@pytest.fixture
def workdir(tmp_path, tiny_tokenizer):
    make_prompts(tiny_tokenizer, tmp_path / "prompts")
    return tmp_path


def test_stage_writes_the_contract(workdir, tiny_target_dir):
    manifest = generate_stage.run(stage_cfg(tiny_target_dir, workdir, topk_logprobs=3))
    train = read_split(workdir / "generated/train")
    assert train.column_names == ["id", "input_ids", "prompt_len", "topk_ids", "topk_logprobs"]
    assert len(train) == 20 and len(set(train["id"])) == 20
    for row in train:
        n_resp = len(row["input_ids"]) - row["prompt_len"]
        assert 1 <= n_resp <= 12
        assert len(row["topk_ids"]) == n_resp and all(len(x) == 3 for x in row["topk_ids"])
    assert manifest["counts"]["train"]["sequences"] == 20 and manifest["counts"]["val"]["sequences"] == 6
    assert manifest["target_fingerprint"].startswith("sha256:")
    assert (workdir / "generated/manifest.json").exists()
    assert sorted(p.name for p in (workdir / "generated/train").iterdir()) == [shard_name(i) for i in range(4)]


def test_rerun_with_nothing_to_do_rewrites_nothing(workdir, tiny_target_dir):
    import hashlib

    cfg = stage_cfg(tiny_target_dir, workdir)
    first = generate_stage.run(cfg)
    files = sorted(p for p in (workdir / "generated").rglob("*") if p.is_file())
    digest = {p: hashlib.md5(p.read_bytes()).hexdigest() for p in files}
    again = generate_stage.run(cfg)
    assert again["this_run"]["shards"] == 0 and again["generation"] == first["generation"]
    assert {p: hashlib.md5(p.read_bytes()).hexdigest() for p in files} == digest  # DVC sees the same output


def tree_digest(folder: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(folder)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_identical_runs_write_identical_bytes(workdir, tiny_target_dir):
    """Two runs from scratch hash the same for DVC (no timing in the data), and the timing goes to metrics."""
    cfg = stage_cfg(tiny_target_dir, workdir, topk_logprobs=2)
    first = generate_stage.run(cfg)
    digest = tree_digest(workdir / "generated")
    import shutil

    shutil.rmtree(workdir / "generated")
    for f in (workdir / "metrics/generate.json", workdir / "metrics/records/generate.json"):  # headline and record
        f.unlink()
    time.sleep(0.01)
    second = generate_stage.run(cfg)
    assert tree_digest(workdir / "generated") == digest
    assert second["counts"] == first["counts"]
    import json

    timing = read_record(workdir / "metrics/generate.json")
    assert timing["fingerprint"] == first["fingerprint"] and timing["generation"]["untimed_shards"] == 0
    assert len(timing["shards"]) == 6 and timing["generation"]["new_tokens"] == sum(
        c["response_tokens"] for c in second["counts"].values())
    assert timing["generation"]["tokens_per_s"] > 0 and timing["environment"]["cpu"]["capability"]
    assert timing["environment"]["dtype"] == cfg["target"]["dtype"]  # the dtype the target answered in
    manifest = json.loads((workdir / "generated/manifest.json").read_text())
    assert manifest["timing"] == str(workdir / "metrics/generate.json") and "generation" not in manifest


def test_timing_inside_an_older_shard_moves_to_metrics(workdir, tiny_target_dir):
    """Shards an older version wrote kept their timing inside: a rerun keeps the shards, moves the timing out."""
    import json

    cfg = stage_cfg(tiny_target_dir, workdir)
    generate_stage.run(cfg)
    digest = tree_digest(workdir / "generated")
    shard = workdir / "generated/train" / shard_name(1)
    (shard / "generation.json").write_text(json.dumps({"new_tokens": 40, "seconds": 2.0}))
    for f in (workdir / "metrics/generate.json", workdir / "metrics/records/generate.json"):  # headline and record
        f.unlink()
    m = generate_stage.run(cfg)
    assert m["this_run"]["shards"] == 0 and tree_digest(workdir / "generated") == digest
    timing = read_record(workdir / "metrics/generate.json")
    assert timing["shards"] == {f"train/{shard_name(1)}": {"new_tokens": 40, "seconds": 2.0}}
    assert timing["generation"] == {"new_tokens": 40, "seconds": 2.0, "tokens_per_s": 20.0, "untimed_shards": 5}


def test_topk_logprobs_are_the_targets(workdir, tiny_target_dir, tiny_model):
    generate_stage.run(stage_cfg(tiny_target_dir, workdir, topk_logprobs=4))
    row = read_split(workdir / "generated/train")[3]
    ids = torch.tensor([row["input_ids"]])
    with torch.no_grad():
        lp = torch.log_softmax(tiny_model(ids).logits[0].float(), -1)
    p = row["prompt_len"]
    for i, (tk, tl) in enumerate(zip(row["topk_ids"], row["topk_logprobs"], strict=True)):
        assert torch.allclose(lp[p - 1 + i, tk], torch.tensor(tl), atol=1e-4)


def test_temperature_zero_equals_greedy_generate(tiny_model, tiny_tokenizer):
    rows = [{"id": str(i), "prompt": apply_template(tiny_tokenizer, [{"role": "user", "content": q}])[0]}
            for i, q in enumerate(QUESTIONS)]
    cfg = GenerateConfig(temperature=0.0, max_new_tokens=16, batch_size=3, compact_below=0.9)
    cols = generate_shard(tiny_model, tiny_tokenizer, rows, cfg, shard_seed=0)
    stops = stop_ids(tiny_model, tiny_tokenizer)
    for seq, plen, r in zip(cols["input_ids"], cols["prompt_len"], rows, strict=True):
        ids = tiny_tokenizer(r["prompt"], add_special_tokens=False, return_tensors="pt").input_ids
        ref = tiny_model.generate(ids, do_sample=False, max_new_tokens=16, pad_token_id=2)[0, ids.shape[1]:].tolist()
        cut = next((i + 1 for i, t in enumerate(ref) if t in stops), len(ref))
        assert seq[plen:] == ref[:cut]


def test_deterministic_for_a_seed_and_seed_sensitive(tiny_model, tiny_tokenizer):
    rows = [{"id": str(i), "prompt": apply_template(tiny_tokenizer, [{"role": "user", "content": q}])[0]}
            for i, q in enumerate(QUESTIONS)]
    cfg = GenerateConfig(temperature=1.0, max_new_tokens=10, batch_size=4)
    a = generate_shard(tiny_model, tiny_tokenizer, rows, cfg, shard_seed=1)
    b = generate_shard(tiny_model, tiny_tokenizer, rows, cfg, shard_seed=1)
    c = generate_shard(tiny_model, tiny_tokenizer, rows, cfg, shard_seed=2)
    assert a == b
    assert a["input_ids"] != c["input_ids"]


def test_dataset_source_uses_the_references(workdir, tiny_target_dir, tiny_tokenizer):
    generate_stage.run(stage_cfg(tiny_target_dir, workdir, source="dataset", topk_logprobs=2))
    row = read_split(workdir / "generated/val")[0]
    ref = tiny_tokenizer("Paris is the capital of France." + tiny_tokenizer.eos_token,
                         add_special_tokens=False)["input_ids"][:12]
    assert row["input_ids"][row["prompt_len"]:] == ref
    assert len(row["topk_ids"]) == len(ref)


def test_changed_config_regenerates(workdir, tiny_target_dir):
    generate_stage.run(stage_cfg(tiny_target_dir, workdir))
    first = read_split(workdir / "generated/train")["input_ids"]
    m = generate_stage.run(stage_cfg(tiny_target_dir, workdir, max_new_tokens=3))
    assert m["this_run"]["shards"] == 6
    assert all(len(s) - p <= 3 for s, p in zip(read_split(workdir / "generated/train")["input_ids"],
                                                 read_split(workdir / "generated/train")["prompt_len"], strict=True))
    assert first != read_split(workdir / "generated/train")["input_ids"]


def test_interrupted_write_leaves_no_half_shard_and_resumes(workdir, tiny_target_dir, monkeypatch):
    cfg = stage_cfg(tiny_target_dir, workdir)
    generate_stage.run(cfg)
    whole = read_split(workdir / "generated/train")
    import shutil

    shutil.rmtree(workdir / "generated")

    real_save, calls = datasets.Dataset.save_to_disk, {"n": 0}

    def dying_save(self, path, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            real_save(self, path, *a, **k)  # the files are written ... and the process dies before the rename
            raise KeyboardInterrupt
        return real_save(self, path, *a, **k)

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", dying_save)
    with pytest.raises(KeyboardInterrupt):
        generate_stage.run(cfg)
    monkeypatch.undo()
    out = workdir / "generated/train"
    assert sorted(p.name for p in out.iterdir()) == [shard_name(0), shard_name(1)]
    m = generate_stage.run(cfg)
    assert m["this_run"]["shards"] == 4  # train shards 2 and 3, val shards 0 and 1
    # the manifest's totals add up every shard, whichever run made it
    assert m["generation"]["new_tokens"] == \
        sum(len(x) - p for x, p in zip(whole["input_ids"], whole["prompt_len"], strict=True)) + \
        sum(len(x) - p for x, p in zip(read_split(workdir / "generated/val")["input_ids"],
                                      read_split(workdir / "generated/val")["prompt_len"], strict=True))
    assert read_split(out)["input_ids"] == whole["input_ids"]


KILL_SCRIPT = textwrap.dedent("""
    import json, sys, time
    import specdistill.stages.generate as g
    real = g.write_shard
    def slow_write(*args, **kwargs):
        real(*args, **kwargs)
        time.sleep(0.4)
    g.write_shard = slow_write
    g.run(json.loads(sys.argv[1]))
""")


def test_sigkill_mid_run_then_resume(workdir, tiny_target_dir):
    import json

    cfg = stage_cfg(tiny_target_dir, workdir, shard_size=2)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, json.dumps(cfg)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = workdir / "generated/train"
    deadline = time.time() + 120
    while time.time() < deadline and len(list(out.glob("shard-*"))) < 3 and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the generating subprocess ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = sorted(p.name for p in out.glob("shard-*"))
    assert 3 <= len(done_before) < 10, done_before
    m = generate_stage.run(cfg)
    assert m["this_run"]["shards"] == 13 - len(done_before)  # 10 train + 3 val shards in all
    ids = read_split(out)["id"]
    assert sorted(ids) == sorted(f"train-{i}" for i in range(20))  # none lost, none duplicated
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no half-written shard left

    ref_dir = workdir / "ref"
    ref_cfg = stage_cfg(tiny_target_dir, ref_dir, shard_size=2)
    ref_cfg["paths"]["prompts_dir"] = cfg["paths"]["prompts_dir"]
    generate_stage.run(ref_cfg)
    assert read_split(out)["input_ids"] == read_split(ref_dir / "generated/train")["input_ids"]


def test_answers_past_the_targets_context_are_refused_before_any_shard_is_touched(workdir, tiny_target_dir):
    """Issue 33, item 5: the tiny target has 512 positions; a prompt plus max_new_tokens past them is refused."""
    generate_stage.run(stage_cfg(tiny_target_dir, workdir))
    before = {p: p.read_bytes() for p in (workdir / "generated").rglob("*") if p.is_file()}
    with pytest.raises(Exception, match=r"split train: its longest prompt has \d+ tokens.*context of 512"):
        generate_stage.run(stage_cfg(tiny_target_dir, workdir, max_new_tokens=500))
    assert {p: p.read_bytes() for p in (workdir / "generated").rglob("*") if p.is_file()} == before


def test_a_second_run_on_the_same_folder_is_refused_while_the_first_writes(workdir, tiny_target_dir):
    """Issue 33, item 6: two runs with different configs in one folder once wiped each other's shards."""
    import json

    first = stage_cfg(tiny_target_dir, workdir, shard_size=2)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, json.dumps(first)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    out = workdir / "generated/train"
    deadline = time.time() + 120
    while time.time() < deadline and not list(out.glob("shard-*")) and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the first run ended before the second could start"
    with pytest.raises(Exception, match=r"another run \(pid \d+\) is writing .*generated .*paths\.generated_dir"):
        generate_stage.run(stage_cfg(tiny_target_dir, workdir, shard_size=2, temperature=0.5))
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-2000:]
    assert sorted(read_split(out)["id"]) == sorted(f"train-{i}" for i in range(20))  # the first run whole
    # the lock goes with its process: once the first ended, the next run proceeds
    assert generate_stage.run(first)["this_run"]["shards"] == 0
