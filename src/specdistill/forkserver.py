"""A fork server for the stages' processes: one warm interpreter imports the heavy libraries once, and every stage
item that DVC starts forks from it instead of importing torch, transformers and Lightning again.

    python -m specdistill.forkserver -- dvc repro [ARGS ...]      (`make repro` runs this)

Why: DVC starts a process per stage item, and a smoke-sized item does a few seconds of work after about 5 s of
imports (docs/findings.md, "What one stage item costs before its work"). DVC still decides and runs every item, with
its per-item caching; only the interpreter an item runs in comes warm.

How: the wrapper starts the server (in its own process group, so a terminal's Ctrl-C reaches the command and not
it), puts the server's socket in SPECDISTILL_FORKSERVER, runs the command and stops the server after it. Where the
engine's environment is made (`make engine`), a second server there imports vLLM (7 s a start) for the engine's
worker (`engine/worker.py`, started by `engine/client.py` under the serve stage's settings; SPECDISTILL_FORKSERVER_
ENGINE). That worker is the server's child, not the stage's, so its script reports its CPU seconds back
(SPECDISTILL_FORKSERVER_CPU, `credit_file`) and the stage counts them as its own, as it counts a cold worker's. A stage
script's first import (`pipelines/_entry.py`) calls `hand_over()`, which sends the script's arguments, working
folder, environment, umask, niceness, CPU affinity, ignored signals and its stdin / stdout / stderr (SCM_RIGHTS) to
the server. The server forks a child, which joins the script's process group (what a terminal or `kill` sends the
group reaches it and what it starts, as it would a cold process), becomes that process and, once the script says go,
runs it as __main__. The script's own process passes on the signals sent to it alone and exits with the child's
status (dying of the same signal where the child did); the child dies with it if it is killed.

What keeps it the same run as a cold start: only third-party libraries are preloaded, never this project's code, so
an edit between two items is seen; the child reseeds `random`, numpy and torch as a fresh process is seeded, and
gets the streams' encodings and error handlers a cold start has; and where the server cannot give the same process
(another interpreter or virtualenv, interpreter options, an environment that differs beyond what a shell and DVC
set per command, a lower niceness), the script runs cold and says why. tests/test_forkserver.py holds it to that.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ENV = "SPECDISTILL_FORKSERVER"
# the engine environment's own server (it imports vLLM): engine/client.py points its worker's ENV at it
ENGINE_ENV = "SPECDISTILL_FORKSERVER_ENGINE"
# a file a script appends its forked child's CPU seconds to: the child is the server's, not the script parent's, so
# the parent's RUSAGE_CHILDREN misses it (the serve stage counts its engine worker's CPU as its own: `credit_file`)
CPU_ENV = "SPECDISTILL_FORKSERVER_CPU"
_CREDITED = [0.0]
MODULE = "specdistill.forkserver"  # not __name__: under `python -m` that is __main__
# the stages' heavy imports (`python -X importtime pipelines/<stage>.py ...`); importing one a stage does not use
# costs the server's start once, not the stage
PRELOAD = ("numpy", "torch", "transformers", "transformers.models.llama.modeling_llama", "lightning.pytorch",
           "torchmetrics", "hydra", "omegaconf", "datasets", "scipy.stats", "safetensors.torch", "wandb", "yaml",
           "tqdm")
ENGINE_PRELOAD = ("torch", "vllm", "vllm.entrypoints.llm", "safetensors.torch")  # the worker's imports (7 s)
# set by a shell or by DVC for each command (DVC_ROOT, DVC_STAGE): no import reads them
VOLATILE = {"PWD", "OLDPWD", "SHLVL", "_"}
VOLATILE_PREFIXES = ("DVC_",)
_ENV_BEFORE: dict[str, str] = {}  # the server's environment before its imports
_IMPORTS_SET: dict[str, str] = {}  # and what they set in it
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what a script passes on to its child
PREFIX = "specdistill-forkserver-"  # the wrapper's folder for the socket
WAIT_S = 120  # how long a script waits for the server to take it (it may still be importing) before running cold


def _send(sock: socket.socket, obj: Any, fds: list[int] | None = None) -> None:
    body = json.dumps(obj).encode()
    head = struct.pack("!I", len(body))
    if fds:
        socket.send_fds(sock, [head], fds)
        sock.sendall(body)
    else:
        sock.sendall(head + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("the peer closed the connection")
        buf += chunk
    return buf


def _recv(sock: socket.socket, max_fds: int = 0) -> tuple[Any, list[int]]:
    fds: list[int] = []
    try:
        if max_fds:
            head, got, _, _ = socket.recv_fds(sock, 4, max_fds)
            fds = list(got)
            if not head:
                raise EOFError("the peer closed the connection")
            head += _recv_exact(sock, 4 - len(head))
        else:
            head = _recv_exact(sock, 4)
        (n,) = struct.unpack("!I", head)
        return json.loads(_recv_exact(sock, n)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _interpreter() -> dict[str, Any]:
    """What makes two processes of this interpreter the same before any import: the binary and the environment it
    runs in (two virtualenvs share a binary), its flags (`-O`, `-B`, `-I`, ... and the PYTHON* variables behind
    them), warning options and `-X` options."""
    return {"executable": os.path.realpath(sys.executable), "prefix": sys.prefix, "exec_prefix": sys.exec_prefix,
            "base_prefix": sys.base_prefix, "flags": list(sys.flags), "warnoptions": list(sys.warnoptions),
            "xoptions": {k: str(v) for k, v in sys._xoptions.items()}}


def _env_differs(theirs: dict[str, str], ours: dict[str, str], imports_set: dict[str, str] | None = None) -> list[str]:
    """Keys whose values differ between a script's environment and the server's before its imports. A key the
    imports set themselves (`imports_set`, torch's TORCHINDUCTOR_CACHE_DIR) may come already set to that value: the
    script's parent imported the same library (the serve stage, torch, before it starts the engine's worker)."""
    def kept(env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items()
                if k not in (ENV, ENGINE_ENV, CPU_ENV) and k not in VOLATILE and not k.startswith(VOLATILE_PREFIXES)}
    a, b, done = kept(theirs), kept(ours), imports_set or {}
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and not (k in done and a.get(k) == done[k]))


# ---------------------------------------------------------------------------------------------- the script's side

def hand_over(scripts: str | Path) -> None:
    """Under a fork server (SPECDISTILL_FORKSERVER), when the running script is one in the folder `scripts`, have a
    warm child run it and exit with its status; without a server, or when it says the child would not be the same
    process, return and run cold. Imported by anything else (a test), it does nothing."""
    path = os.environ.get(ENV)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not main_file or not sys.argv or not sys.argv[0]:
        return
    script = os.path.abspath(sys.argv[0])
    if os.path.dirname(script) != os.path.abspath(scripts) or os.path.abspath(main_file) != script:
        return
    options = sys.orig_argv[1:len(sys.orig_argv) - len(sys.argv)]  # between the interpreter and the script
    if options:
        print(f"{MODULE}: running cold: interpreter options {options}", file=sys.stderr)
        return
    # signals this process came with ignored (nohup, `&` in a script) stay ignored in the child, as they would cold
    ignored = [int(s) for s in SIGNALS if signal.getsignal(s) is signal.SIG_IGN]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(WAIT_S)
        sock.connect(path)
        umask = os.umask(0)
        os.umask(umask)
        _send(sock, {"argv": sys.argv, "script": script, "cwd": os.getcwd(), "env": dict(os.environ),
                     "umask": umask, "nice": os.getpriority(os.PRIO_PROCESS, 0), "pgid": os.getpgrp(),
                     "affinity": sorted(os.sched_getaffinity(0)), "ignored": ignored,
                     "interpreter": _interpreter()}, [0, 1, 2])
        reply, _ = _recv(sock)
    except (OSError, EOFError, ValueError) as e:  # no server (a stale variable), or it did not answer in time
        print(f"{MODULE}: running cold: the server at {path} did not take the script ({e})", file=sys.stderr)
        sock.close()
        return
    if "cold" in reply:
        print(f"{MODULE}: running cold: {reply['cold']}", file=sys.stderr)
        sock.close()
        return
    child = reply["pid"]
    # the child is in this process's group (`grouped`), so what a terminal sends the foreground group (Ctrl-C, a
    # hang-up, Ctrl-Z) and a kill of the group reach it already: pass on only what was sent to this process alone
    from_terminal = (signal.SIGINT, signal.SIGHUP) if reply.get("grouped") and _in_foreground() else ()

    def forward(signum: int, _frame: Any) -> None:
        if signum not in from_terminal:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)

    for signum in SIGNALS:
        if int(signum) not in ignored:
            signal.signal(signum, forward)
    sock.settimeout(None)
    try:
        sock.sendall(b"g")  # the child runs only now: had this process given up waiting, it would never run
        ended = _recv(sock)[0]
        status = ended["status"]
    except (OSError, EOFError, ValueError):
        print(f"{MODULE}: the server went away before child {child} ended: its exit status is lost",
              file=sys.stderr)
        os._exit(1)
    if os.environ.get(CPU_ENV):
        with contextlib.suppress(OSError), open(os.environ[CPU_ENV], "a") as f:
            f.write(f"{ended.get('cpu', 0.0)}\n")
    if status < 0:  # killed by a signal: die of the same one, as the cold process would have
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be set, and needs no setting
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        status = 128 - status
    os._exit(status)


def credit_file(path: str | Path) -> float:
    """Count the CPU seconds a script's forked children wrote to `path` (CPU_ENV) as this process's children's
    (`credited_cpu_seconds`); the seconds added."""
    try:
        seconds = sum(float(line) for line in Path(path).read_text().split())
    except (OSError, ValueError):
        return 0.0
    _CREDITED[0] += seconds
    return seconds


def credited_cpu_seconds() -> float:
    """CPU seconds of children that ran forked from a server on this process's behalf (`credit_file`)."""
    return _CREDITED[0]


def _in_foreground() -> bool:
    """Whether this process's group is its terminal's foreground group (a Ctrl-C there reaches the whole group)."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY)
    except OSError:
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- the server's side

def serve(path: str, preload: tuple[str, ...] = PRELOAD) -> None:
    """Import `preload`, then fork a child for every script that connects to the socket at `path`, until SIGTERM or
    until the process that started the server is gone."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)  # scripts that come while the imports run wait here
    t0 = time.perf_counter()
    before = dict(os.environ)
    for name in preload:
        importlib.import_module(name)
    # the imported objects to the collector's permanent generation (Python's advice for a server that forks without
    # exec): else the child's first full collection writes to every object's header, and the kernel copies each
    # page it touches (a forked engine worker started 0.7-1.3 s slower than a cold one, with ~40k more page faults)
    gc.collect()
    gc.freeze()
    # what the imports put in the environment (torch sets TORCHINDUCTOR_CACHE_DIR, ...): a cold process has it too
    global _IMPORTS_SET, _ENV_BEFORE
    _IMPORTS_SET = {k: v for k, v in os.environ.items() if before.get(k) != v}
    _ENV_BEFORE = before
    print(f"{MODULE}: {len(preload)} libraries imported in {time.perf_counter() - t0:.1f} s; stage scripts fork "
          "from here", file=sys.stderr, flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    children: dict[int, socket.socket] = {}
    while not stop and os.getppid() == parent:
        try:
            ready, _, _ = select.select([listener], [], [], 0.2)
        except InterruptedError:
            ready = []
        if ready:
            conn, _ = listener.accept()
            pid = _take(conn, listener, children)
            if pid:
                children[pid] = conn
            else:
                conn.close()
        _reap(children)
    for sig in (signal.SIGTERM, signal.SIGKILL):  # children left when the command ended: none outlive the server
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while children and time.monotonic() < deadline:
            _reap(children)
            time.sleep(0.1)
    listener.close()
    with contextlib.suppress(OSError):  # the wrapper removes these too, unless it was killed
        os.unlink(path)
        if os.path.basename(os.path.dirname(path)).startswith(PREFIX):
            os.rmdir(os.path.dirname(path))


def _reap(children: dict[int, socket.socket]) -> None:
    """Send each ended child's exit status (negative: the signal that killed it) and CPU seconds (its own and its
    reaped children's) to its script."""
    while children:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        code = os.waitstatus_to_exitcode(status)
        try:
            _send(conn, {"status": code, "cpu": round(usage.ru_utime + usage.ru_stime, 3)})
        except OSError:
            pass  # its script is gone
        conn.close()


def _take(conn: socket.socket, listener: socket.socket, children: dict[int, socket.socket]) -> int | None:
    """Read a script's request; fork its child, or say why it runs cold. The child's pid, or None."""
    try:
        conn.settimeout(10)
        request, fds = _recv(conn, max_fds=3)
        conn.settimeout(None)
    except (OSError, EOFError, ValueError):
        return None
    try:
        why = _why_cold(request, fds)
    except Exception as e:  # noqa: BLE001 (a request this server cannot read: another checkout's, say)
        why = f"the server could not read the request ({e!r})"
    pid = None
    if not why:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as e:
            why = f"the server could not fork ({e})"
    if pid == 0:
        listener.close()
        for other in children.values():
            other.close()
        _become(request, fds, conn)  # never returns
    for fd in fds:
        os.close(fd)
    if why:
        with contextlib.suppress(OSError):
            _send(conn, {"cold": why})
        return None
    grouped = False
    with contextlib.suppress(OSError):  # the child joins the script's process group; set from both sides, no race
        os.setpgid(pid, request["pgid"])
        grouped = os.getpgid(pid) == request["pgid"]
    try:
        _send(conn, {"pid": pid, "grouped": grouped})
    except OSError:
        os.kill(pid, signal.SIGKILL)  # the script is gone; the child waits for its go and never ran
    return pid


def _why_cold(request: dict[str, Any], fds: list[int]) -> str | None:
    if len(fds) != 3:
        return f"the script sent {len(fds)} of its 3 standard files"
    ours = _interpreter()
    for key, theirs in request["interpreter"].items():
        if theirs != ours.get(key):
            return f"the server's interpreter differs in {key} ({ours.get(key)} here, {theirs} in the script)"
    differ = _env_differs(request["env"], _ENV_BEFORE, _IMPORTS_SET)
    if differ:
        return (f"the environment differs from the server's in {', '.join(differ[:8])}"
                f"{' ...' if len(differ) > 8 else ''}: an import may have read it")
    if request["nice"] < os.getpriority(os.PRIO_PROCESS, 0):
        return "the script runs at a lower niceness than the server"
    return None


def _become(request: dict[str, Any], fds: list[int], conn: socket.socket) -> None:
    """In the forked child: turn into the script's process and run it; exit as the interpreter would."""
    import random
    import threading
    import traceback

    with contextlib.suppress(OSError):
        os.setpgid(0, request["pgid"])
    try:
        go = conn.recv(1)  # the script's go: without it (it gave up waiting and runs cold) this never runs
    except OSError:
        go = b""
    if not go:
        os._exit(0)
    for signum in SIGNALS:  # as a cold start has them: ignored where the script's were, else Python's defaults
        default = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        signal.signal(signum, signal.SIG_IGN if int(signum) in request["ignored"] else default)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    env = {**request["env"], **_IMPORTS_SET}
    env.pop(ENV, None)  # what this child starts runs cold: a nested script must not queue behind it
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    if request["nice"] > os.getpriority(os.PRIO_PROCESS, 0):
        os.setpriority(os.PRIO_PROCESS, 0, request["nice"])
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, request["affinity"])
    _standard_streams(unbuffered=bool(env.get("PYTHONUNBUFFERED")))
    random.seed()  # a fresh process seeds these from the OS, not from the server's state
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(request["script"])
    package = MODULE.split(".")[0]  # the server's own import of this project: the script imports its checkout's
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[name]

    def watch() -> None:  # the script's process vanished without passing a signal on (SIGKILL): as cold, die now
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="forkserver-watch", daemon=True).start()
    code = 0
    try:
        _run_main(request["script"])
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    _finish()
    os._exit(code & 0xFF)


def _standard_streams(unbuffered: bool) -> None:
    """sys.stdin / stdout / stderr over the script's files (now fds 0-2), with the encoding, error handler and
    buffering a cold start gives them (line-buffered stdout on a terminal, `-u` / PYTHONUNBUFFERED)."""
    import io

    def stream(fd: int, like: Any, write: bool, **kw: Any) -> io.TextIOWrapper:
        raw = open(fd, "wb" if write else "rb", 0 if (write and unbuffered) else -1, closefd=False)  # noqa: SIM115
        return io.TextIOWrapper(raw, encoding=getattr(like, "encoding", None) or "utf-8",
                                errors=getattr(like, "errors", None) or "strict", **kw)

    sys.stdin = sys.__stdin__ = stream(0, sys.__stdin__, False)
    sys.stdout = sys.__stdout__ = stream(1, sys.__stdout__, True, line_buffering=os.isatty(1),
                                         write_through=unbuffered)
    sys.stderr = sys.__stderr__ = stream(2, sys.__stderr__, True, line_buffering=True, write_through=unbuffered)


def _run_main(path: str) -> None:
    """Run the script as `python path` does: a fresh __main__ module with an absolute __file__, sys.argv as the
    script was given it (runpy would make argv[0] absolute)."""
    import builtins
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__file__, main.__cached__, main.__builtins__ = path, None, builtins
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    sys.modules["__main__"] = main
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    exec(code, main.__dict__)  # noqa: S102


def _finish() -> None:
    """What the interpreter does on its way out: wait for non-daemon threads, run atexit, flush."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass


# ---------------------------------------------------------------------------------------------- the wrapper

def run(command: list[str], preload: tuple[str, ...] = PRELOAD, engine: bool = True) -> int:
    """Run `command` with a fork server beside it (and, with `engine` and an engine environment, one in that
    environment for the engine's worker); the command's exit status."""
    folder = tempfile.mkdtemp(prefix=PREFIX)
    plain = {k: v for k, v in os.environ.items() if k not in (ENV, ENGINE_ENV)}
    wanted = {ENV: (Path(sys.executable), os.path.join(folder, "socket"), preload, plain)}
    if engine and (spec := _engine_spec(plain)):
        wanted[ENGINE_ENV] = (spec[0], os.path.join(folder, "engine.socket"), ENGINE_PRELOAD, spec[1])
    servers = [subprocess.Popen([str(py), str(Path(__file__).resolve()), "--serve", path, "--preload", *mods],
                                process_group=0, env=env)
               for py, path, mods, env in wanted.values()]
    try:
        deadline = time.monotonic() + 30
        while (not all(os.path.exists(w[1]) for w in wanted.values()) and time.monotonic() < deadline
               and all(s.poll() is None for s in servers)):
            time.sleep(0.05)
        env = {**plain, **{key: w[1] for key, w in wanted.items() if os.path.exists(w[1])}}
        if ENV not in env:
            print(f"{MODULE}: the server did not start: running {command[0]} without it", file=sys.stderr)
        proc = subprocess.Popen(command, env=env)
        for signum in (signal.SIGTERM, signal.SIGHUP):  # passed on: the command ends its own way, then the server
            signal.signal(signum, lambda signum, _frame: proc.send_signal(signum))
        while True:
            try:
                code = proc.wait()
                return 128 - code if code < 0 else code  # killed by a signal: as a shell reports it
            except KeyboardInterrupt:  # a terminal's Ctrl-C reached the command too: let it finish its own way
                continue
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                server.kill()
        shutil.rmtree(folder, ignore_errors=True)


def _engine_spec(env: dict[str, str]) -> tuple[Path, dict[str, str]] | None:
    """The engine environment's Python and the environment the serve stage starts its worker in (params.yaml's
    serve.threads / iomp / multiprocessing, else conf's defaults); None without an engine environment or those
    settings. Another stage's settings (a features run's threads) differ from these, and its worker runs cold."""
    try:
        import yaml

        from specdistill.engine.environment import engine_env, engine_python
        python = engine_python()
    except Exception:  # noqa: BLE001 (no engine environment: nothing to preload)
        return None
    serve: dict[str, Any] = {}
    for file, key in (("params.yaml", "serve"), ("conf/serve/default.yaml", None)):
        with contextlib.suppress(OSError, ValueError, AttributeError, yaml.YAMLError):
            loaded = yaml.safe_load(Path(file).read_text())
            serve = (loaded.get(key) if key else loaded) or {}
        if serve:
            break
    try:
        return python, engine_env(python, serve["threads"], bool(serve["iomp"]),
                                  multiprocessing=bool(serve["multiprocessing"]), base=env)
    except KeyError:  # no serve settings to start the worker under: it runs cold
        return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0],
        epilog="e.g. python -m specdistill.forkserver -- dvc repro; a stage run outside it (or with "
               f"{ENV} unset) starts cold, as before")
    ap.add_argument("--preload", nargs="*", default=None, metavar="MODULE",
                    help=f"the modules the server imports (default: {' '.join(PRELOAD)})")
    ap.add_argument("--no-engine", action="store_true",
                    help="no second server in the engine's environment (.venv-engine) for its worker")
    ap.add_argument("--serve", metavar="SOCKET", help=argparse.SUPPRESS)  # how the wrapper starts each server
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command to run beside the server, after --")
    args = ap.parse_args(argv)
    preload = tuple(args.preload) if args.preload is not None else PRELOAD
    if args.serve:
        serve(args.serve, preload)
        return
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("name the command to run, e.g. -- dvc repro")
    sys.exit(run(command, preload, engine=not args.no_engine))


if __name__ == "__main__":
    main()
