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
import os, sys
sys.path.insert(0, {str(SRC)!r})
from specdistill.forkserver import hand_over
hand_over(os.path.dirname(os.path.abspath(__file__)))
import specdistill
mode = "warm" if {PROBE!r} in sys.modules else "cold"
print(mode, __name__, os.getpid(), " ".join(sys.argv[1:]), os.getcwd(), os.environ.get("PROBE_VAR"),
      getattr(specdistill, "MARK", "-"), sys.stdin.readline().strip(), sep="|")
print("to stderr", file=sys.stderr)
what = sys.argv[1] if len(sys.argv) > 1 else ""
if what == "raise":
    raise RuntimeError("boom")
if what == "sleep":
    open(sys.argv[2], "w").write(str(os.getpid()))
    import time
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


def _run(scripts: Path, env: dict[str, str], *args: str, stdin: str = "a line\n", cwd: Path | None = None):
    return subprocess.run([sys.executable, str(scripts / "probe.py"), *args], env=env, input=stdin, text=True,
                          capture_output=True, cwd=cwd or scripts.parent, timeout=60)


def _fields(out: str) -> list[str]:
    return out.strip().splitlines()[-1].split("|")


def test_a_script_runs_warm_as_it_would_cold(scripts: Path, server) -> None:
    env = server[1]
    cold = _run(scripts, {k: v for k, v in env.items() if k != forkserver.ENV}, "3", "two words")
    warm = _run(scripts, env, "3", "two words")
    assert warm.returncode == cold.returncode == 3
    assert _fields(cold.stdout)[0] == "cold" and _fields(warm.stdout)[0] == "warm"
    # name, arguments, folder, environment, stdin: the same; the pid is the child's
    assert _fields(warm.stdout)[1] == "__main__"
    assert _fields(warm.stdout)[3:] == _fields(cold.stdout)[3:] == ["3 two words", str(scripts.parent), "x", "-",
                                                                    "a line"]
    assert "to stderr" in warm.stderr and "running cold" not in warm.stderr


def test_an_uncaught_error_exits_1_with_its_traceback(scripts: Path, server) -> None:
    out = _run(scripts, server[1], "raise")
    assert out.returncode == 1 and _fields(out.stdout)[0] == "warm"
    assert "RuntimeError: boom" in out.stderr


def test_a_different_environment_or_no_server_runs_cold_and_says_why(scripts: Path, server, tmp_path: Path) -> None:
    out = _run(scripts, {**server[1], "PROBE_VAR": "only here"})
    assert out.returncode == 0 and _fields(out.stdout)[0] == "cold"
    assert "running cold: the environment differs from the server's in PROBE_VAR" in out.stderr
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


def _pid_from(path: Path) -> int:
    deadline = time.monotonic() + 30
    while not (path.exists() and path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return int(path.read_text())


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
    pid_file = tmp_path / "child.pid"
    proc = subprocess.Popen([sys.executable, str(scripts / "probe.py"), "sleep", str(pid_file)], env=server[1],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child = _pid_from(pid_file)
    assert child != proc.pid
    proc.send_signal(sig)
    assert proc.wait(30) == -sig
    assert _gone(child)


def test_the_wrapper_runs_the_command_beside_a_server_and_cleans_up(scripts: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != forkserver.ENV}
    cmd = [sys.executable, "-m", "specdistill.forkserver", "--preload", PROBE, "--",
           "sh", "-c", f'echo "$SPECDISTILL_FORKSERVER"; exec {sys.executable} {scripts / "probe.py"} 5']
    out = subprocess.run(cmd, env=env, input="in\n", text=True, capture_output=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 5
    assert _fields(out.stdout)[0] == "warm" and _fields(out.stdout)[-1] == "in"
    assert "1 libraries imported" in out.stderr
    assert not Path(out.stdout.splitlines()[0]).parent.exists()  # the socket's folder is removed


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
