"""The benchmark scripts still import and parse their arguments (they run on the pipeline's outputs, which
tests do not build, so `--help` is what guards them against the code moving under them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted(p for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py")
                 if not p.name.startswith("_"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_benchmark_help(script):
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("usage:") and "--help" in out.stdout


@pytest.mark.parametrize("branches", [1, 3])
def test_lookup_replay_equals_real_decoding_along_the_same_answer(branches, tiny_tokenizer):
    """benchmarks/lookup_replay.py's tau is the speculative loop's wherever decoding follows AR's answer (in float32
    it always does): the same forwards, token for token, without the target."""
    sys.path.insert(0, str(SCRIPTS[0].parent))
    from lookup_replay import replay

    from specdistill.decoding.loop import speculative_generate
    from specdistill.decoding.verifier import TargetVerifier
    from specdistill.methods.lookup.proposer import PromptLookupProposer

    from .helpers.models import make_model
    target = make_model(len(tiny_tokenizer), seed=0)
    proposer = PromptLookupProposer(k=4, branches=branches)
    gained = 0
    for prompt, stops in (([1, 5, 9, 13, 5, 9, 40], set()), ([1, 77, 3, 12, 77, 3], set()),
                          ([1, 200, 201, 202, 200, 201], set()),
                          ([1, 5, 9, 13, 5, 9, 40], {9, 13})):  # the last one stops early: the budget is max_new_tokens
        ar = speculative_generate(TargetVerifier(target, 128), None, prompt, 40, stops)
        spec = speculative_generate(TargetVerifier(target, 128), proposer, prompt, 40, stops)
        assert spec.tokens == ar.tokens
        tokens, forwards, nodes = replay({"prompt": prompt, "tokens": ar.tokens}, proposer, 40)
        assert (tokens, forwards, nodes) == (len(spec.tokens), spec.target_forwards,
                                             sum(r.draft_len for r in spec.rounds))
        gained += spec.target_forwards < len(spec.tokens)
    assert gained  # lookup was accepted somewhere: the comparison covered accepted drafts, not only empty rounds


def test_timed_repro_gives_each_stage_its_minutes(tmp_path):
    """benchmarks/repro_times.py and the smoke test read where a `dvc repro` spent its time from DVC's own output."""
    import os

    from .helpers.checkout import minutes_table, timed_repro

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([str(Path(sys.executable).parent / "dvc"), "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.yaml").write_text("stages:\n  first:\n    cmd: sleep 1.5 && echo a > a.txt\n    outs: [a.txt]\n"
                                       "  second:\n    foreach: [x, y]\n    do:\n      cmd: cat a.txt > ${item}.txt\n"
                                       "      deps: [a.txt]\n      outs: ['${item}.txt']\n")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    seen = []
    code, out, minutes = timed_repro(tmp_path, env, 120, lambda stage, at: seen.append(stage))
    assert code == 0, out
    assert list(minutes) == seen == ["first", "second@x", "second@y"]
    assert minutes["first"] > 1.4 / 60 and all(m >= 0 for m in minutes.values())
    table = minutes_table(minutes)
    assert "second " in table and table.splitlines()[-1].startswith("total")
