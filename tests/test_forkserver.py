"""The fork server (`python -m specdistill.forkserver -- CMD`): a script handed to it runs in a warm child as it would
have run cold (arguments, folder, environment, standard files, exit status, signals, this checkout's code), and
runs cold, saying why, where the child would not be the same process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdistill import forkserver

from .helpers.project import ROOT

SRC = ROOT / "src"
PROBE = "colorsys"  # preloaded by these tests' servers, imported by nothing else: its presence says "warm"

SCRIPT = f'''
import os, sys, time
sys.path.insert(0, {str(SRC)!r})
from specdistill.forkserver import hand_over
hand_over(os.path.dirname(os.path.abspath(__file__)))
import specdistill
mode = "warm" if {PROBE!r} in sys.modules else "cold"
line = sys.stdin.readline().strip()
print(mode, __name__, os.getpid(), " ".join(sys.argv[1:]), os.getcwd(), os.environ.get("PROBE_VAR"),
      getattr(specdistill, "MARK", "-"), sys.argv[0], __file__, os.getpgrp(), sys.stdout.encoding, sys.stdout.errors,
      sys.stdin.errors, line, sep="|")
print("to stderr", file=sys.stderr)
what = sys.argv[1] if len(sys.argv) > 1 else ""
if what == "burn":  # CPU seconds its parent's RUSAGE_CHILDREN would count, were it the parent's child
    t = time.process_time()
    while time.process_time() - t < 0.5:
        pass
if what == "gc":  # how many objects the collector leaves alone (the server's imports, when warm)
    import gc
    print("frozen", gc.get_freeze_count(), file=sys.stderr)
if what == "raise":
    raise RuntimeError("boom")
if what == "sleep":  # its own pid and a subprocess's (as a stage starts the engine), then wait
    import subprocess, time
    sub = subprocess.Popen(["sleep", "60"])
    open(sys.argv[2], "w").write(f"{{os.getpid()}} {{sub.pid}}")
    time.sleep(60)
sys.exit(int(what) if what.isdigit() else 0)
'''


@pytest.fixture
def scripts(tmp_path: Path) -> Path:
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "probe.py").write_text(SCRIPT)
    return folder


@pytest.fixture
def server(tmp_path: Path):
    """A running server preloading PROBE, and the environment that reaches it."""
    path = str(tmp_path / "fs.sock")
    env = {**{k: v for k, v in os.environ.items() if k != forkserver.ENV}, "PROBE_VAR": "x"}
    proc = subprocess.Popen([sys.executable, "-c", f"from specdistill.forkserver import serve; serve({path!r}, "
                             f"({PROBE!r},))"], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    yield path, {**env, forkserver.ENV: path}
    proc.terminate()
    proc.wait(15)


def _run(scripts: Path, env: dict[str, str], *args: str, python: str = sys.executable):
    """The probe as DVC runs a stage: `python pipelines/probe.py ...` from the checkout's root."""
    return subprocess.run([python, "pipelines/probe.py", *args], env=env, input="a line\n", text=True,
                          capture_output=True, cwd=scripts.parent, timeout=60)


def _fields(out: str) -> list[str]:
    return out.strip().splitlines()[-1].split("|")


def test_a_script_runs_warm_as_it_would_cold(scripts: Path, server) -> None:
    env = server[1]
    cold = _run(scripts, {k: v for k, v in env.items() if k != forkserver.ENV}, "3", "two words")
    warm = _run(scripts, env, "3", "two words")
    assert warm.returncode == cold.returncode == 3
    assert _fields(cold.stdout)[0] == "cold" and _fields(warm.stdout)[0] == "warm"
    # name, arguments (argv[0] as given), folder, environment, __file__ (absolute), process group, the streams'
    # encoding and error handlers, stdin: the same; the pid is the child's
    assert _fields(warm.stdout)[1] == "__main__" and _fields(warm.stdout)[2] != str(os.getpid())
    assert _fields(warm.stdout)[3:] == _fields(cold.stdout)[3:]
    assert _fields(cold.stdout)[3:9] == ["3 two words", str(scripts.parent), "x", "-", "pipelines/probe.py",
                                         str(scripts / "probe.py")]
    assert _fields(cold.stdout)[-1] == "a line"
    assert "to stderr" in warm.stderr and "running cold" not in warm.stderr


def test_an_uncaught_error_exits_1_with_its_traceback(scripts: Path, server) -> None:
    out = _run(scripts, server[1], "raise")
    assert out.returncode == 1 and _fields(out.stdout)[0] == "warm"
    assert "RuntimeError: boom" in out.stderr


def test_a_different_environment_or_no_server_runs_cold_and_says_why(scripts: Path, server, tmp_path: Path) -> None:
    out = _run(scripts, {**server[1], "PROBE_VAR": "only here"})
    assert out.returncode == 0 and _fields(out.stdout)[0] == "cold"
    assert "running cold: the environment differs from the server's in PROBE_VAR" in out.stderr
    # another virtualenv over the same Python binary: other site-packages, so cold
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    other = _run(scripts, server[1], python=str(tmp_path / "venv" / "bin" / "python"))
    assert _fields(other.stdout)[0] == "cold" and "interpreter differs in prefix" in other.stderr
    gone = _run(scripts, {**server[1], forkserver.ENV: str(tmp_path / "no.sock")})
    assert gone.returncode == 0 and _fields(gone.stdout)[0] == "cold" and "did not take the script" in gone.stderr
    # DVC's own per-command variables change nothing an import read: still warm
    dvc = _run(scripts, {**server[1], "DVC_STAGE": "probe", "DVC_ROOT": str(tmp_path)})
    assert _fields(dvc.stdout)[0] == "warm"


def test_the_child_imports_the_checkouts_code_not_the_servers(scripts: Path, server, tmp_path: Path) -> None:
    """The server imported this project to run; a script that puts another checkout's src first gets that one."""
    other = tmp_path / "other" / "specdistill"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text('MARK = "the other checkout"\n')
    (other / "forkserver.py").write_text((SRC / "specdistill" / "forkserver.py").read_text())
    (scripts / "probe.py").write_text(SCRIPT.replace(repr(str(SRC)), repr(str(other.parent))))
    out = _run(scripts, server[1])
    assert _fields(out.stdout)[0] == "warm" and _fields(out.stdout)[6] == "the other checkout"


def _pids_from(path: Path) -> list[int]:
    """The sleeping probe's pid and its subprocess's."""
    deadline = time.monotonic() + 30
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [int(p) for p in path.read_text().split()]


def _sleeping(scripts: Path, env: dict[str, str], pid_file: Path, **kw) -> tuple[subprocess.Popen, int, int]:
    proc = subprocess.Popen([sys.executable, str(scripts / "probe.py"), "sleep", str(pid_file)], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
    child, sub = _pids_from(pid_file)
    return proc, child, sub


def _gone(pid: int, within: float = 10) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_to_the_script_ends_its_child(scripts: Path, server, tmp_path: Path, sig: int) -> None:
    """SIGTERM is forwarded (and the script dies of it); after SIGKILL, which cannot be, the child ends itself."""
    proc, child, sub = _sleeping(scripts, server[1], tmp_path / "child.pid")
    assert child != proc.pid
    proc.send_signal(sig)
    assert proc.wait(30) == -sig
    assert _gone(child)
    os.kill(sub, signal.SIGKILL)  # a subprocess outlives a killed process, warm or cold


def test_the_child_is_in_the_scripts_process_group(scripts: Path, server, tmp_path: Path) -> None:
    """What a terminal or a killer sends the group (Ctrl-C, Ctrl-Z, killpg) reaches the child and what it started,
    as it would reach a cold process: here a SIGINT to the group ends the probe and the `sleep` it started."""
    # SIGINT as a terminal leaves it: a shell without job control starts a background job (`make test &`) with
    # SIGINT ignored, and a script that inherits that, cold or warm, outlives a Ctrl-C
    proc, child, sub = _sleeping(scripts, server[1], tmp_path / "child.pid", process_group=0,  # as DVC's group
                                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert os.getpgid(child) == os.getpgid(sub) == proc.pid
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(30) == -signal.SIGINT
    assert _gone(child) and _gone(sub)


def test_signals_the_script_ignored_stay_ignored_and_a_killed_child_kills_the_script(scripts: Path, server,
                                                                                   tmp_path: Path) -> None:
    """Under nohup (SIGHUP ignored) a hang-up leaves the child running, as it would a cold process; a child killed
    by SIGKILL (the OOM killer) ends its script with the same signal, not an error of the server's."""
    proc, child, sub = _sleeping(scripts, server[1], tmp_path / "child.pid", process_group=0,
                                 preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    os.killpg(proc.pid, signal.SIGHUP)  # as a terminal's hang-up reaches its foreground group
    assert not _gone(child, within=1) and proc.poll() is None
    os.kill(child, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    os.kill(sub, signal.SIGKILL)  # it holds the pipe open
    assert b"Traceback" not in proc.stderr.read()


def test_the_wrapper_runs_the_command_beside_a_server_and_cleans_up(scripts: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != forkserver.ENV}
    cmd = [sys.executable, "-m", "specdistill.forkserver", "--no-engine", "--preload", PROBE, "--",
           "sh", "-c", f'echo "$SPECDISTILL_FORKSERVER"; exec {sys.executable} {scripts / "probe.py"} 5']
    out = subprocess.run(cmd, env=env, input="in\n", text=True, capture_output=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 5
    assert _fields(out.stdout)[0] == "warm" and _fields(out.stdout)[-1] == "in"
    assert "1 libraries imported" in out.stderr
    assert not Path(out.stdout.splitlines()[0]).parent.exists()  # the socket's folder is removed


def test_a_killed_wrapper_takes_its_server_and_socket_with_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != forkserver.ENV}
    wrapper = subprocess.Popen([sys.executable, "-m", "specdistill.forkserver", "--no-engine", "--preload", PROBE,
                                "--", "sh", "-c",
                                'echo "$SPECDISTILL_FORKSERVER"; exec sleep 30'], env=env, stdout=subprocess.PIPE,
                               text=True)
    socket_path = Path(wrapper.stdout.readline().strip())
    assert socket_path.exists()
    wrapper.kill()
    wrapper.wait()
    deadline = time.monotonic() + 10
    while socket_path.parent.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not socket_path.parent.exists()  # the server saw its parent go, and left nothing behind


def test_a_stage_script_prints_the_same_warm_and_cold(server) -> None:
    """A real stage's front door (`pipelines/_entry.py`) hands over: its --help is the same either way."""
    cold_env = {k: v for k, v in server[1].items() if k != forkserver.ENV}
    run = [sys.executable, str(ROOT / "pipelines" / "evaluate.py"), "--help"]
    cold = subprocess.run(run, env=cold_env, capture_output=True, text=True, cwd=ROOT, timeout=120)
    warm = subprocess.run(run, env=server[1], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert cold.returncode == warm.returncode == 0 and warm.stdout == cold.stdout
    assert "running cold" not in warm.stderr


def test_the_wrapper_needs_a_command() -> None:
    with pytest.raises(SystemExit) as e:
        forkserver.main([])
    assert e.value.code == 2


def test_a_forked_childs_cpu_is_reported_to_the_script_and_credited(scripts: Path, server, tmp_path: Path) -> None:
    """The child is the server's, so the script's parent (the serve stage, for the engine's worker) would not see
    its CPU in RUSAGE_CHILDREN: the script writes it where CPU_ENV says, and `credit_file` adds it to ours."""
    cpu_file = tmp_path / "cpu"
    out = _run(scripts, {**server[1], forkserver.CPU_ENV: str(cpu_file)}, "burn")
    assert out.returncode == 0 and _fields(out.stdout)[0] == "warm"
    reported = float(cpu_file.read_text())
    assert 0.45 <= reported < 5
    before = forkserver.credited_cpu_seconds()
    assert forkserver.credit_file(cpu_file) == reported
    assert forkserver.credited_cpu_seconds() == before + reported
    assert forkserver.credit_file(tmp_path / "none") == 0.0  # a cold worker writes nothing


def test_the_servers_imports_are_frozen_so_the_childs_collections_leave_their_pages_shared(scripts: Path,
                                                                                           server) -> None:
    """gc.freeze() after the imports: a child's full collection would otherwise write to every imported object's
    header and the kernel copy each page it touches (a forked engine worker started ~1 s slower than a cold one)."""
    warm, cold = _run(scripts, server[1], "gc"), _run(scripts, {k: v for k, v in server[1].items()
                                                                  if k != forkserver.ENV}, "gc")
    assert _fields(warm.stdout)[0] == "warm" and _fields(cold.stdout)[0] == "cold"
    assert "frozen 0" in cold.stderr
    assert int(warm.stderr.split("frozen ")[1].split()[0]) > 1000


def test_a_key_the_servers_imports_set_may_come_set_to_the_same_value() -> None:
    """The serve stage has imported torch (which sets TORCHINDUCTOR_CACHE_DIR) before it starts the engine's worker;
    the engine's server imported torch after its environment was taken. The same value is the same start; another
    value, or any other key, is not."""
    before, done = {"A": "1"}, {"TORCHINDUCTOR_CACHE_DIR": "/tmp/x"}
    assert forkserver._env_differs({"A": "1", "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"}, before, done) == []
    assert forkserver._env_differs({"A": "1", "TORCHINDUCTOR_CACHE_DIR": "/tmp/y"}, before, done) == [
        "TORCHINDUCTOR_CACHE_DIR"]
    assert forkserver._env_differs({"A": "2", "DVC_STAGE": "s", forkserver.CPU_ENV: "f"}, before, done) == ["A"]
