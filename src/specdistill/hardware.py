"""What kind of machine a run is on: the facts that set a speed-up's size, kept apart from the models so
every stage can record them without importing a model."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` knows ("x86_64" at worst)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN has bfloat16 kernels on this CPU (AVX512 / AMX on x86). Without them PyTorch emulates
    bf16 matmuls: a one-token decode step still gains from the halved weights, but every multi-token forward
    (generate's batches, prefill, a draft tree's verification) runs several times slower than float32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: assume the hardware does (no warning)
        return True
