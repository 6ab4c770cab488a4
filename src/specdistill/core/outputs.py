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
import stat
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

MARKER = ".specdistill-output"  # in every folder a stage replaces whole; its text names who wrote it (stable: DVC hash)
MARKER_TEXT = "written by specdistill: the stage that wrote this folder replaces it whole on its next run\n"  # before
# owners were named; still replaceable by any stage (the paths checks still keep one stage off another's folders)
MAX_NAME = 100  # names become file names with prefixes and suffixes (`train_<name>.json`, `<name>.lock`)
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=,@-]*")
# paths.* keys that are not output folders a stage fills: W&B writes its own `wandb/` below wandb_dir
_NOT_OUTPUTS = {"wandb_dir"}
# the paths.* folders that a stage replaces (or may wipe) whole; the others only hold named outputs
_REPLACED_WHOLE = ("generated_dir", "features_dir", "reports_dir")


class OutputError(ValueError):
    """A config value would make a stage write outside its outputs or delete what it did not write."""


def plain_name(value: Any, key: str) -> str:
    """`value` as one path component, or an error that names the key, the value and the rule."""
    if isinstance(value, str) and len(value) > MAX_NAME:  # a file system's limit (255 bytes) with room to spare
        raise OutputError(f"`{key}=` a name of {len(value)} characters: it names a folder or file, so it must be a "
                          f"plain name of at most {MAX_NAME} characters (e.g. `{key}=my_run`)")
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
    # every other pair too: a stage derives folders inside its own (plots/<eval.name>, models/<distill.output>)
    # and replaces them whole, so one folder inside another lets an item's name reach the other's contents
    # (`paths.plots_dir=models` replaced the draft it had just measured with its plots)
    for key, p in resolved.items():
        for other, q in resolved.items():
            if other != key and _inside(q, p) and (p != q or key < other):
                how = "is also" if p == q else "contains"
                raise OutputError(f"`paths.{key}={paths[key]}` {how} `paths.{other}={paths[other]}`: the stages "
                                  f"name folders inside each, so one could replace what another wrote. Give each "
                                  f"its own folder (e.g. `paths.{key}={_default_hint(key)}`)")


def _default_hint(key: str) -> str:
    return {"generated_dir": "data/generated", "features_dir": "data/features", "reports_dir": "reports/default",
            "prompts_dir": "data/prompts", "assets_dir": "data/assets", "metrics_dir": "metrics",
            "plots_dir": "plots", "models_dir": "models", "checkpoints_dir": "checkpoints"}.get(key, "data/" + key)


def owner_text(key: str, experiment: str | None = None) -> str:
    """The marker's text for a folder the output `key` names (`distill.output`, `eval.name`, `paths.reports_dir`):
    the same on every rerun of that item, another for any other key, and for a report another experiment's."""
    who = key + (f" of experiment {experiment}" if experiment else "")
    return f"written by specdistill ({who}): only that output replaces it whole on its next run\n"


_claims: dict[Path, str] = {}  # folder -> the marker text of the output this process will write there


def claim(folder: str | Path, text: str) -> None:
    """Say which output this process writes to `folder`: the marker it gets (`mark`), and the owner a folder
    already there must have for the stage to replace it (`check_replaceable`)."""
    _claims[Path(folder).resolve()] = text


def claimed(folder: str | Path) -> str | None:
    return _claims.get(Path(folder).resolve())


def _who(text: str) -> str:
    """The output an `owner_text` names (a marker of another form: its text)."""
    return text.split("(", 1)[1].split(")", 1)[0] if "(" in text else text.strip()[:80]


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
        mine = claimed(folder)
        theirs = (folder / MARKER).read_text() if (folder / MARKER).is_file() else None
        # an old marker (MARKER_TEXT) names no output: any stage's, as before
        if mine is not None and theirs not in (None, MARKER_TEXT, mine):
            raise OutputError(f"the output folder {folder} (from `{key}`) was written by another output "
                              f"({_who(theirs)}), and this run writes {_who(mine)}: it will not be replaced. Choose "
                              f"another `{key}`, or move or delete {folder} yourself")
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
    lock = lock_folder() / f"{hashlib.sha1(str(path).encode()).hexdigest()}.lock"
    if lock in _held:
        return
    # O_NOFOLLOW: a link planted under the lock's name is refused, never followed and truncated
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise OutputError(f"cannot open the lock file {lock} for {path} (from `{key}`): {e.strerror}. It should be a "
                          f"plain file of yours; remove it (a run holds no lock it could not open)") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        os.close(fd)
        raise OutputError(f"the lock file {lock} for {path} (from `{key}`) is not a plain file of yours: remove it")
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


def lock_folder() -> Path:
    """This user's lock folder in the machine's temporary folder, made 0700: a folder shared by every user (0755,
    made by whoever came first) left the others unable to lock at all, and let them plant links in it. Refused
    when it is not a folder of this user's that only they can write."""
    folder = Path(tempfile.gettempdir()) / f"specdistill-locks-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise OutputError(f"the lock folder {folder} is not a folder of yours that only you can write (a link, "
                          f"another user's, or open to others): remove it, or set TMPDIR to a folder of your own")
    return folder


def mark(folder: str | Path, final: str | Path | None = None) -> None:
    """Write the marker that lets the output that claimed `final` (else any stage) replace this folder on its
    next run."""
    (Path(folder) / MARKER).write_text((claimed(final) if final is not None else None) or MARKER_TEXT)
