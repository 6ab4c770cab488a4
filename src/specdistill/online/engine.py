"""The trainer's side of online distillation with vLLM as the server (`engine/online_worker.py` is the engine's).

The engine runs in its own process and environment and serves the stream; this process keeps the student. They
share a folder (the channel): the engine appends each finished request to `requests.jsonl`, this side reads it,
turns it into the `RequestRecord` the rejection buffer takes (the same as our decoder's recorder makes) and, after
an update, writes the new weights whole under a new name and then points `CURRENT.json` at them (both by rename,
so the engine never reads a half-written file); the engine loads them between two of its steps.

From the engine's own outputs: a decode step of a request emits its accepted drafts and one token of the target's
(the correction, or the bonus when all K were accepted), so the tokens each step emitted say where the draft was
right and where it was first wrong; the request's logprobs are the target's at each output position (vLLM takes
them from the verification pass), the teacher there.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from specdistill.online.recorder import RequestRecord
from specdistill.online.server import Served

CURRENT = "CURRENT.json"  # the names engine/online_worker.py reads and writes
REQUESTS = "requests.jsonl"


@dataclass
class EngineServing:
    """`online.engine`: how vLLM serves the stream (stage online_engine@<method>)."""

    # online_engine@<key> (dvc.yaml makes one per key): the offline draft each method starts from in the engine
    items: dict = field(default_factory=lambda: {"draft": "models/draft_full", "eagle": "models/eagle"})
    k: dict = field(default_factory=lambda: {"draft": 2, "eagle": 3})  # method -> drafted tokens per step
    concurrency: int = 1  # requests in flight
    dtype: str | None = None  # null: target.dtype
    threads: str | None = "0-1"  # VLLM_CPU_OMP_THREADS_BIND (serve.threads)
    iomp: bool = True
    max_model_len: int = 2048
    timeout_s: int = 3600
    RANGES: ClassVar[dict[str, str]] = {"concurrency": "[1, 256]", "max_model_len": "[64, inf)",
                                        "timeout_s": "[1, inf)"}

    def __post_init__(self) -> None:
        for method, k in self.k.items():
            if not isinstance(k, int) or not 1 <= k <= 16:
                raise ValueError(f"online.engine.k.{method}={k!r}: an integer in [1, 16]")
        if self.dtype not in (None, "float32", "bfloat16"):
            raise ValueError(f"online.engine.dtype={self.dtype!r}: use float32, bfloat16 or null")


class Channel:
    """The folder the trainer and the engine share."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.version = 0

    def deploy(self, weights: dict[str, torch.Tensor], final: bool = False) -> int:
        """Hand the engine a new drafter version: the weights file whole first, then the pointer to it. The one
        before the previous version is deleted (the engine has moved past it), so a long stream keeps two."""
        from safetensors.torch import save_file

        self.version += 1
        name = f"v{self.version:04d}.safetensors"
        tmp = self.folder / f".{name}.tmp"
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp))
        os.replace(tmp, self.folder / name)
        self._point(name, final)
        (self.folder / f"v{self.version - 2:04d}.safetensors").unlink(missing_ok=True)
        return self.version

    def finish(self) -> None:
        """The trainer has learnt from the whole stream: the engine may serve what comes after it."""
        self._point(f"v{self.version:04d}.safetensors", final=True)

    def _point(self, name: str, final: bool) -> None:
        tmp = self.folder / f".{CURRENT}.tmp"
        tmp.write_text(json.dumps({"version": self.version, "file": name, "final": final}))
        os.replace(tmp, self.folder / CURRENT)

    def requests(self, engine: Any, timeout_s: float) -> Iterator[dict[str, Any]]:
        """Each request the engine finishes, as it finishes; ends when the engine exits (an EngineError with its
        log when it failed, or when it is still running after `timeout_s`)."""
        from specdistill.engine.environment import EngineError

        path, buf = self.folder / REQUESTS, ""
        path.touch()
        deadline = time.monotonic() + timeout_s
        with open(path) as fh:
            while True:
                chunk = fh.read()
                if chunk:
                    buf += chunk
                    *lines, buf = buf.split("\n")  # a line is whole once its newline is there
                    for line in lines:
                        if line:
                            yield json.loads(line)
                    continue
                if engine.proc.poll() is not None:
                    if engine.proc.returncode != 0:
                        raise engine.failure()
                    return
                if time.monotonic() > deadline:
                    engine.kill()
                    raise EngineError(f"the engine did not finish the online stream within {timeout_s:.0f} s "
                                      f"(log: {engine.log_file})")
                time.sleep(0.05)


def _judged(row: dict[str, Any], k: int) -> Iterator[tuple[int, int, bool]]:
    """(step, output index, accepted) of each draft position the engine judged in a request. The first step
    (prefill) judges no draft; a later step that emitted n tokens accepted its first n - 1 drafts and, unless all
    k were accepted, rejected the n-th (the target's correction stands there). A request's last step may be cut by
    max_tokens or a stop token, so only its accepted drafts count (what follows them is unknown)."""
    steps = row["steps"]
    out = steps[0]  # the output index of the step's first token
    for s, n in enumerate(steps[1:], start=1):
        for d in range(n - 1):
            yield s, out + d, True
        if n - 1 < k and s < len(steps) - 1:
            yield s, out + n - 1, False
        out += n


def request_record(prompt: list[int], row: dict[str, Any], k: int) -> RequestRecord:
    """The engine's request as our recorder would have kept it: positions index prompt + output, position t
    holding the target's distribution of token t + 1 (k: the drafted tokens per step)."""
    rec = RequestRecord(tokens=list(prompt) + list(row["token_ids"]), prompt_len=len(prompt))
    ids, lps = row.get("topk_ids"), row.get("topk_logprobs")
    for _, o, ok in _judged(row, k):
        rec.positions.append(len(prompt) + o - 1)
        rec.accepted.append(ok)
        if ids is not None:
            rec.topk_ids.append(torch.tensor(ids[o], dtype=torch.long))
            rec.topk_logprobs.append(torch.tensor(lps[o], dtype=torch.float32))
    return rec


def version_rate(row: dict[str, Any], k: int, version: int) -> float | None:
    """The request's acceptance if drafter `version` made all of its drafts, else None. The engine keeps serving
    while the trainer updates, so the request in flight then is partly the previous version's: the drafts a step
    judges were proposed at the end of the step before (the worker records the version loaded before each step),
    and a new version still reads the draft's cache of the prompt that the old one wrote. So only requests the
    version served from their prefill judge it, as in our decoder (one version per request)."""
    versions = row["versions"]
    if any(v != version for v in versions[:-1]):  # the last step's proposals are never judged
        return None
    marks = [ok for _, _, ok in _judged(row, k)]
    return sum(marks) / len(marks) if marks else None


def served(row: dict[str, Any], record: RequestRecord) -> Served:
    """One row of the curve, as our decoder's server logs it (tau: tokens per target forward, prefill included;
    version: the drafter version that proposed the drafts the request's last step judged)."""
    tokens, forwards = len(row["token_ids"]), len(row["steps"])
    versions = row["versions"]
    return Served(int(row["index"]), tokens, forwards - 1, record.num_accepted, len(record.accepted),
                  tokens / forwards if forwards else 0.0, float(row["seconds"]),
                  versions[-2] if len(versions) > 1 else (versions or [0])[0])


def throughput(steps: list[list[float]], updates: list[Any]) -> dict[str, Any]:
    """The engine's output tokens/s over its learning-phase steps, those that ran while the trainer was updating
    (the two share the machine) against the others."""
    spans = [(u.started, u.started + u.seconds) for u in updates]
    during, outside = [], []
    for s in steps:
        (during if any(a <= s[0] <= b for a, b in spans) else outside).append(s)

    def rate(rows: list[list[float]]) -> float | None:
        secs = sum(r[2] for r in rows)
        return round(sum(r[1] for r in rows) / secs, 2) if secs else None

    during_rate, outside_rate = rate(during), rate(outside)
    return {"steps_during_updates": len(during), "steps_outside": len(outside),
            "tokens_per_s_during_updates": during_rate, "tokens_per_s_outside": outside_rate,
            "update_slowdown": (round(outside_rate / during_rate, 3) if during_rate and outside_rate else None)}
