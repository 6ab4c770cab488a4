"""Runs INSIDE the engine's virtualenv (`.venv-engine`, which has speculators): what speculators' trainer assumes of
a CUDA machine, handled from outside so that it trains on a CPU-only torch, the package unedited. stdlib + torch.

Each shim is one assumption, patched where the trainer looks it up, and undone by the callable it returns:

- `device`: `Trainer` moves the model and every batch to `get_local_rank()`, an int, which torch reads as cuda:0
  ("Torch not compiled with CUDA enabled" / no accelerator); the trainer's module gets a `get_local_rank` that says
  "cpu" (its distributed helpers keep theirs: one process, rank 0);
- `autocast`: with no accelerator the trainer picks `device_type="cuda"` for its bf16 autocast, which torch then
  disables, and the bf16 hidden states meet float32 layers ("expected m1 and m2 to have the same dtype");
  autocast must name the CPU;
- `synchronize`: its step timer calls `torch.accelerator.synchronize()` on each logged step, which raises without
  an accelerator; on a CPU every op has finished when it returns, so there is nothing to wait for;
- `resume`: a rerun resumes from the last epoch's checkpoint, which its checkpointer loads onto
  `get_current_device()`, "cuda:0" without an accelerator (safetensors then asks for pinned memory and fails).

tests/test_reference.py trains (or resumes) a tiny draft without each shim in turn and fails when one is no longer
needed (a newer speculators that runs on a CPU without it), so a shim never outlives its reason.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Undo = Callable[[], None]


def device() -> Undo:
    import speculators.train.trainer as trainer

    before = trainer.get_local_rank
    trainer.get_local_rank = lambda: torch.device("cpu")

    def undo() -> None:
        trainer.get_local_rank = before
    return undo


def autocast() -> Undo:
    import speculators.train.trainer as trainer

    init = trainer.Trainer.__init__

    def on_cpu(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        init(self, *args, **kwargs)
        if torch.accelerator.current_accelerator() is None:
            self.device_type = "cpu"  # what its autocast names; read only at autocast

    trainer.Trainer.__init__ = on_cpu

    def undo() -> None:
        trainer.Trainer.__init__ = init
    return undo


def synchronize() -> Undo:
    before = torch.accelerator.synchronize

    def on_cpu(*args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if torch.accelerator.current_accelerator() is not None:
            before(*args, **kwargs)

    torch.accelerator.synchronize = on_cpu

    def undo() -> None:
        torch.accelerator.synchronize = before
    return undo


def resume() -> Undo:
    import speculators.train.checkpointer as checkpointer

    before = checkpointer.get_current_device

    def on_cpu() -> str:
        return before() if torch.accelerator.current_accelerator() is not None else "cpu"

    checkpointer.get_current_device = on_cpu

    def undo() -> None:
        checkpointer.get_current_device = before
    return undo


# name -> (the shim, what the traceback shows without it on a CPU-only torch: the test's evidence that it is needed;
# `device` and `synchronize` raise the same "Cannot access accelerator device", from these lines)
SHIMS: dict[str, tuple[Callable[[], Undo], str]] = {
    "device": (device, "self.model.to(self.local_rank)"),
    "autocast": (autocast, "expected m1 and m2 to have the same dtype"),
    "synchronize": (synchronize, "torch.accelerator.synchronize()"),
    "resume": (resume, "requires a CUDA or other accelerator backend"),
}


def apply(names: list[str] | None = None) -> list[Undo]:
    """Apply the shims named (default: all of them); the undo of each, in order."""
    return [SHIMS[n][0]() for n in (list(SHIMS) if names is None else names)]
