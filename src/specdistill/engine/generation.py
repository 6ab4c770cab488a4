"""generate.engine=vllm: the serving engine answers the prompts, data-parallel, with the own loop's output contract.

The generate stage plans the shards and tokenises the prompts as it does for its own loop; here the shards left to
do are dealt round-robin to `engine_workers` engine processes (one per GPU group on a GPU node, one per group of
cores on a CPU), each started once and answering its shards in order. A worker writes a shard's answers the moment
the shard is whole; this side turns each into the same Arrow shard the own loop writes, so the output is the same
contract: shards, manifest, resume after a kill (whole shards kept, none duplicated). Each request samples with its
own seed (the shard's seed + its row), so which worker runs a shard does not change its tokens; at T=0 two workers
give what one gives.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from specdistill.engine.client import EngineError, EngineProcess

log = logging.getLogger(__name__)

POLL_S = 1.0


def worker_envs(workers: int, device: str, tp: int,
                cores: list[int] | None = None) -> list[tuple[str | None, dict[str, str]]]:
    """(cores to bind, extra environment) of each worker: on a GPU node `tp` GPUs apiece; on a CPU the machine's cores
    in equal contiguous groups (vLLM's OpenMP binding), an error when there are fewer cores than workers."""
    if device == "cuda":
        return [(None, {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in range(w * tp, (w + 1) * tp))})
                for w in range(workers)]
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    if len(cores) < workers:
        raise EngineError(f"generate.engine_workers={workers} on {len(cores)} core(s): at most one worker per core")
    per = len(cores) // workers
    return [(",".join(str(c) for c in cores[w * per:(w + 1) * per]), {}) for w in range(workers)]


def deal(shards: list[dict[str, Any]], workers: int) -> list[list[dict[str, Any]]]:
    """Shards to workers round-robin, each worker's in plan order (so a kill leaves few holes)."""
    return [shards[w::workers] for w in range(workers) if shards[w::workers]]


def generate_with_engine(job: dict[str, Any], shards: list[dict[str, Any]], *, workers: int, device: str, tp: int,
                         timeout_s: float,
                         on_shard: Callable[[str, list[dict[str, Any]], float], None]) -> list[dict[str, Any]]:
    """Run `shards` ({key, prompts, seed}) through `workers` engines; `on_shard(key, rows, seconds)` for each shard
    as it completes (rows: {response, topk_ids?, topk_logprobs?} in prompt order). Returns each worker's result
    (cold start, versions). Any worker failing stops the others and raises its error with its log."""
    with tempfile.TemporaryDirectory(prefix="specdistill-generate-") as tmp:
        out = Path(tmp)
        jobs = [({**job, "shards": part, "out_dir": str(out)}, cores, env)
                for part, (cores, env) in zip(deal(shards, workers), worker_envs(workers, device, tp), strict=False)]

        def drain() -> None:
            for key, rows, seconds in completed(out):
                on_shard(key, rows, seconds)

        return run_workers(jobs, timeout_s, drain, "generation")


def run_workers(jobs: list[tuple[dict[str, Any], str | None, dict[str, str]]], timeout_s: float,
                drain: Callable[[], None], what: str) -> list[dict[str, Any]]:
    """Start one engine worker per (job, cores, environment) side by side, call `drain` (which hands on what they
    finished) until every worker exits, and return their results; a failing worker stops the others and raises its
    error with its log; none outlives this call."""
    procs: list[EngineProcess] = []
    try:
        for job, cores, env in jobs:
            procs.append(EngineProcess(job, threads=cores, relay=False, env=env))
            log.info("engine worker %d started (log %s)", len(procs) - 1, procs[-1].log_file)
        deadline = time.monotonic() + timeout_s
        while True:
            drain()
            if all(p.proc.poll() is not None for p in procs):
                drain()  # what was written as the last worker exited
                return [p.finish() for p in procs]  # raises the first failure, with its log
            if failed := [p for p in procs if p.proc.poll() not in (None, 0)]:
                raise failed[0].failure()
            if time.monotonic() > deadline:
                raise EngineError(f"the engine's {what} did not finish within {timeout_s:.0f} s (logs: "
                                  f"{', '.join(str(p.log_file) for p in procs)})")
            time.sleep(POLL_S)
    finally:
        for p in procs:
            p.kill()


def completed(out: Path) -> Iterator[tuple[str, list[dict[str, Any]], float]]:
    """Shards the workers have finished (each file is renamed into place whole), read and removed."""
    for f in sorted(out.glob("*.json")):
        result = json.loads(f.read_text())
        f.unlink()
        yield result["key"], result["rows"], float(result["seconds"])
