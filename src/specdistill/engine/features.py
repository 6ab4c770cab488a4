"""features.engine=vllm: the serving engine computes the features store's content, with the own pass's contract.

The features stage picks the rows and their kept spans (`kept_spans`) as for its own pass; here the shards left to
do are dealt round-robin to `engine_workers` engine processes (as generate.engine=vllm deals its shards), each
started once with vLLM's `extract_hidden_states` method and engine-plugin/'s hidden-states connector. A worker runs
each row once (its tokens as the prompt, one token generated), takes the hidden states at the requested layers and
the top-k prompt log-probs at each response position, and writes a shard's file the moment the shard is whole; this
side hands each to the stage, which writes it with `write_shard`: the same store, resumable by shard.

The engine's layer ids are our HiddenTap indices (id k: the residual stream entering decoder layer k, 0 the
embeddings, num_layers the final norm's input), and its prompt log-probs are the raw log-softmax at temperature 1.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from specdistill.engine.generation import deal, run_workers, worker_envs

Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def features_with_engine(job: dict[str, Any], shards: list[dict[str, Any]], *, layers: list[int], topk: int,
                         workers: int, device: str, timeout_s: float,
                         on_shard: Callable[[str, Part, float], None]) -> list[dict[str, Any]]:
    """Run `shards` ({key, rows: [[token ids, p, r], ...]}) through `workers` engines; `on_shard(key, (features
    [sum(p+r), H * len(layers)], topk_ids [sum(r), k], topk_logprobs [sum(r), k]), seconds)` for each shard as it
    completes, rows in the order given. Returns each worker's result; any worker failing stops the others and
    raises its error with its log."""
    with tempfile.TemporaryDirectory(prefix="specdistill-features-") as tmp:
        out = Path(tmp)
        jobs = [({**job, "features": {"layers": list(layers), "topk": topk, "out_dir": str(out), "shards": part}},
                 cores, env)
                for part, (cores, env) in zip(deal(shards, workers), worker_envs(workers, device, 1), strict=False)]

        def drain() -> None:
            for key, part_, seconds in completed(out):
                on_shard(key, part_, seconds)

        return run_workers(jobs, timeout_s, drain, "features")


def completed(out: Path) -> Iterator[tuple[str, Part, float]]:
    """Shards the workers have finished (each file is renamed into place whole), read and removed."""
    from safetensors import safe_open

    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            meta = h.metadata()
            part = (h.get_tensor("features"), h.get_tensor("topk_ids"), h.get_tensor("topk_logprobs"))
        f.unlink()
        yield meta["key"], part, float(meta["seconds"])


def job_for(model_dir: str | Path, *, revision: str | None, dtype: str, longest: int, context: int | None,
            batch_size: int, seed: int = 0) -> dict[str, Any]:
    """The engine settings of a features job: room for the longest row and the one token each request generates."""
    max_len = longest + 8
    if context is not None:
        max_len = min(max_len, max(context, longest + 1))
    return {"target": str(model_dir), "revision": revision, "dtype": dtype, "max_model_len": max_len,
            "max_num_seqs": batch_size, "seed": seed}


def describe(results: list[dict[str, Any]]) -> dict[str, Any]:
    """What this run's engine workers report (for the stage's `this_run`)."""
    return {"workers": len(results), "cold_start_s": [round(r["cold_start_s"], 1) for r in results],
            "fixes": sorted({f for r in results for f in r.get("fixes", [])})}

