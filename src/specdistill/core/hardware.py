"""What kind of machine a run is on: the facts that set a speed-up's size, kept apart from the models so
every stage can record them without importing a model."""

from __future__ import annotations

import platform
from pathlib import Path
from typing import Any

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


def computes_bf16(device: str) -> bool:
    """Whether `device` ("cpu", "cuda", "cuda:1", or Lightning's "gpu") computes bfloat16 in hardware: a GPU that
    supports it, a CPU with AVX512-BF16 or AMX. What `target.dtype=auto` and `trainer.precision=auto` follow."""
    if str(device).startswith(("cuda", "gpu")):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return cpu_has_native_bf16()


def auto_precision(accelerator: str) -> str:
    """`trainer.precision=auto`: bf16 mixed precision where the hardware computes bf16, else 16-mixed on a GPU and
    full float32 on a CPU. Emulated bf16 autocast on an AVX2 CPU made train@draft's first two smoke steps take 46 s
    and 91 s; in float32 its whole 4-step item took 70 s (docs/findings.md, "The smoke run on an AVX2 CPU")."""
    gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    return "bf16-mixed" if computes_bf16("cuda" if gpu else "cpu") else "16-mixed" if gpu else "32-true"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux: /proc/cpuinfo); empty where they cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def matrix_units() -> str | None:
    """What runs a bf16 matmul: "AMX" (tile units), "AVX512-BF16" (native bf16 dot products, no tiles), or None
    (emulated or unknown). torch's capability says "AVX512" for the first two alike; what each costs a draft
    tree's verification is benchmarks/verify_cost.py's to measure on the machine at hand."""
    flags = cpu_flags()
    return "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else None


def environment() -> dict[str, Any]:
    """What a measurement ran on. On a CPU the kind matters as much as the versions: without bf16 kernels
    (AVX2) a draft tree's verification costs several times more plain steps than with AMX, so a speed-up
    only compares with one measured on the same kind."""
    import transformers

    cuda = torch.cuda.is_available()
    env: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                           "python": platform.python_version(),
                           "device": torch.cuda.get_device_name(0) if cuda else cpu_name(),
                           "threads": torch.get_num_threads()}
    if not cuda:
        env["cpu"] = {"capability": torch.backends.cpu.get_cpu_capability(), "native_bf16": cpu_has_native_bf16(),
                      "matrix_units": matrix_units()}
    return env
