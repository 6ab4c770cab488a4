"""Where a stage may write and what it may delete: no config value reaches outside the stage's own outputs.

A stage replaces some folders whole (`models/<name>`, `plots/<name>`, `reports/<experiment>`, a checkpoint or
generated-data folder of another configuration). A config value decides where those are, so a value such as
`eval.name=..` or `paths.reports_dir=.` once named the checkout itself and the stage deleted it. Three rules:

- a name that becomes part of a path (`eval.name`, `distill.output`, `experiment_name`, ...) is a plain name:
  one path component, no separator, not `.` or `..`, not hidden;
- no configured folder is the project or one of its ancestors, and a folder a stage replaces whole contains
  no other configured folder (`paths.generated_dir=data` would hold `data/prompts`);
- a stage deletes only what it wrote itself: a folder that carries its marker (`MARKER`, written by
  `io.atomic_path`, or the `FINGERPRINT` of a resumable output), or an empty one.

`check_paths` and `check_replaceable` run at a stage's start, before any model loads; `io.atomic_path` and the
resumable outputs check again at the moment they delete, so a folder that appeared meanwhile is safe too.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

MARKER = ".specdistill-output"  # in every folder a stage replaces whole; its content never changes (stable DVC hash)
MARKER_TEXT = "written by specdistill: the stage that wrote this folder replaces it whole on its next run\n"
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=,@-]*")
# paths.* keys that are not output folders a stage fills: W&B writes its own `wandb/` below wandb_dir
_NOT_OUTPUTS = {"wandb_dir"}
# the paths.* folders that a stage replaces (or may wipe) whole; the others only hold named outputs
_REPLACED_WHOLE = ("generated_dir", "features_dir", "reports_dir")


class OutputError(ValueError):
    """A config value would make a stage write outside its outputs or delete what it did not write."""


def plain_name(value: Any, key: str) -> str:
    """`value` as one path component, or an error that names the key, the value and the rule."""
    if not isinstance(value, str) or not _PLAIN.fullmatch(value):
        raise OutputError(f"`{key}={value}`: it names a folder or file, so it must be a plain name: letters, digits "
                          f"and _ . + = , @ -, starting with a letter or digit, no '/' and not '.' or '..' "
                          f"(e.g. `{key}=my_run`)")
    return value


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_paths(paths: Mapping[str, Any], root: str | Path | None = None) -> None:
    """No `paths.*` folder is the project or above it; a folder replaced whole contains no other one."""
    root_ = Path(root or Path.cwd()).resolve()
    resolved = {k: (root_ / v).resolve() for k, v in paths.items() if k not in _NOT_OUTPUTS and v is not None}
    for key, p in resolved.items():
        if _inside(root_, p):
            what = "the project itself" if p == root_ else "a folder that contains the project"
            raise OutputError(f"`paths.{key}={paths[key]}` resolves to {p}, {what}: stages write and replace folders "
                              f"there, which could delete the checkout. Name a folder inside the project "
                              f"(e.g. `paths.{key}={_default_hint(key)}`) or elsewhere on disk")
    for key, p in resolved.items():  # a file where a folder goes fails now, not after hours of work
        blocker = next((a for a in (p, *p.parents) if a.exists() or a.is_symlink()), None)
        if blocker is not None and not blocker.is_dir():
            raise OutputError(f"`paths.{key}={paths[key]}`: {blocker} is a file, where a stage needs a folder. "
                              f"Move the file away or choose another `paths.{key}`")
    for key in _REPLACED_WHOLE:
        if key not in resolved:
            continue
        for other, q in resolved.items():
            if other != key and _inside(q, resolved[key]):
                raise OutputError(f"`paths.{key}={paths[key]}` contains `paths.{other}={paths[other]}`: the stage that "
                                  f"writes paths.{key} replaces it whole and would delete the other. Give each its own "
                                  f"folder (e.g. `paths.{key}={_default_hint(key)}`)")


def _default_hint(key: str) -> str:
    return {"generated_dir": "data/generated", "features_dir": "data/features", "reports_dir": "reports/default",
            "prompts_dir": "data/prompts", "assets_dir": "data/assets", "metrics_dir": "metrics",
            "plots_dir": "plots", "models_dir": "models", "checkpoints_dir": "checkpoints"}.get(key, "data/" + key)


def is_ours(folder: str | Path, markers: Iterable[str] = (MARKER,)) -> bool:
    """Whether a stage may delete `folder`: it carries one of our markers, or it is empty."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        return False
    return any((folder / m).is_file() for m in markers) or not any(folder.iterdir())


def check_replaceable(folder: str | Path, key: str, markers: Iterable[str] = (MARKER,),
                      root: str | Path | None = None) -> Path:
    """Refuse, before any work, to later replace `folder` if a stage did not write it (or it is the project)."""
    folder, markers, root_ = Path(folder), tuple(markers), Path(root or Path.cwd()).resolve()
    resolved = (root_ / folder).resolve()
    if _inside(root_, resolved):
        raise OutputError(f"`{key}` makes the output folder {folder} ({resolved}), which is or contains the project: "
                          f"a stage replaces its output folder whole. Choose a folder inside the project")
    if folder.exists() or folder.is_symlink():
        if folder.is_symlink() or not folder.is_dir():
            raise OutputError(f"the output {folder} (from `{key}`) exists and is not a folder a stage wrote "
                              f"(a file or a link): move it away, or choose another `{key}`")
        if not is_ours(folder, markers):
            raise OutputError(f"the output folder {folder} (from `{key}`) exists and was not written by this stage "
                              f"(no {' or '.join(markers)} in it), so it will not be replaced: choose another `{key}`, "
                              f"or move or delete {folder} yourself if it is an old output")
    return folder


def check_files(files: Mapping[str, str | Path]) -> None:
    """Each output file's path can be written: not a folder, and no file where one of its folders goes."""
    for key, f in files.items():
        f = Path(f)
        if f.is_dir():
            raise OutputError(f"the output file {f} (from `{key}`) is a folder: move it away or choose another `{key}`")
        blocker = next((a for a in f.parents if a.exists() or a.is_symlink()), None)
        if blocker is not None and not blocker.is_dir():
            raise OutputError(f"the output file {f} (from `{key}`) cannot be written: {blocker} is a file, where a "
                              "folder goes. Move it away")


_held: dict[Path, int] = {}  # lock file -> descriptor, held until the process ends (the OS releases it then)


RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID")  # torchrun / Lightning, then srun's


def is_rank_zero() -> bool:
    """Whether this process is the first of its run: torchrun sets RANK / LOCAL_RANK, srun only SLURM_PROCID /
    SLURM_LOCALID (Lightning reads those under SLURM), so each is asked; a process none names is rank zero."""
    return all(os.environ.get(v, "0") == "0" for v in RANK_VARIABLES)


def lock_output(path: str | Path, key: str) -> None:
    """Hold an exclusive lock on one output (a folder or a file) for the rest of this process, or refuse at
    once when another run holds it: two runs writing one folder once wiped each other's shards.

    The lock is a file named by the output's absolute path in the machine's temporary folder, so nothing
    appears in the project (a refused run leaves no trace), locked with `flock`, so a killed run leaves no
    stale lock. It guards one machine: runs on two nodes of a shared file system do not see each other's.
    Only the first process of a distributed run locks (the other ranks write nothing of their own)."""
    if not is_rank_zero():
        return
    path = Path(path).resolve()
    lock = Path(tempfile.gettempdir()) / "specdistill-locks" / f"{hashlib.sha1(str(path).encode()).hexdigest()}.lock"
    if lock in _held:
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise OutputError(f"another run ({holder}) is writing {path} (from `{key}`): wait for it to finish, or give "
                          f"this run another output (`{key}`)") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}\n".encode())
    _held[lock] = fd


def mark(folder: str | Path) -> None:
    """Write the marker that lets the stage replace this folder on its next run."""
    (Path(folder) / MARKER).write_text(MARKER_TEXT)
