"""How fast a run trains: tokens and seconds of its optimizer steps, and the process's peak memory, for the train
record (and the reference trainer's table beside speculators', which times its epochs the same way)."""

from __future__ import annotations

import resource
import time
from typing import Any

from lightning.pytorch.callbacks import Callback


class Throughput(Callback):
    """Sums each training batch's real tokens (its attention mask) and the seconds from the batch's start to the end
    of its optimizer step; validation passes and checkpoints are not in it. A resumed run counts its own steps."""

    def __init__(self) -> None:
        self.tokens, self.seconds, self.steps = 0, 0.0, 0
        self._start: float | None = None

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.tokens += int(batch["attention_mask"].sum())
            self.steps += 1

    def record(self) -> dict[str, Any]:
        return {"steps": self.steps, "tokens": self.tokens, "train_s": round(self.seconds, 2),
                "tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds > 0 else None,
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
