"""Small file helpers shared by the stages: atomic writes and hashing.

Every stage writes under a temporary name in the destination folder and renames when whole, so a
killed stage never leaves a half-written file under its final name (rename is atomic on POSIX).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specdistill.core.outputs import check_replaceable, mark

CACHE_ENV = "SPECDISTILL_CACHE"


def cache_root() -> Path | None:
    """The project's cache folder (`$SPECDISTILL_CACHE`, else `$XDG_CACHE_HOME/specdistill`, `~/.cache/...`), or
    None when `SPECDISTILL_CACHE=off`."""
    env = os.environ.get(CACHE_ENV, "")
    if env.lower() in ("off", "0", "false", "none"):
        return None
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdistill"


def sha256_cached(path: str | Path) -> str:
    """sha256_file, kept in the project's cache under the file's stat (`sha256_cached_all`)."""
    return sha256_cached_all([path])[0]


def sha256_cached_all(paths: list[str | Path]) -> list[str]:
    """Each file's sha256, kept in the project's cache (`<cache>/file_sha256.json`) under its path, size, mtime and
    inode, as DVC keeps its hashes: a file is read again only when it changed (nothing kept with
    SPECDISTILL_CACHE=off). One read and at most one write of the store for all of them. Processes writing at once
    may drop each other's new entries: those are hashed again later."""
    keys = []
    for path in paths:
        p = Path(path)
        st = p.stat()
        keys.append((p, f"{p.resolve()}|", f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"))
    root = cache_root()
    store = root / "file_sha256.json" if root is not None else None
    known: dict[str, str] = {}
    if store is not None:
        with contextlib.suppress(OSError, ValueError):
            known = json.loads(store.read_text())
    missing = [(p, where, key) for p, where, key in keys if key not in known]
    if missing:
        # a path keeps one entry (its older versions go) and a file that is gone keeps none (a test's temporary
        # folders), so the store grows with the files that exist, not with their edits
        stale = tuple(where for _, where, _ in missing)
        known = {k: v for k, v in known.items() if not k.startswith(stale) and os.path.exists(k.rsplit("|", 3)[0])}
        known.update({key: sha256_file(p) for p, _, key in missing})
        if store is not None:
            with contextlib.suppress(OSError):
                write_json(store, known)
    return [known[key] for _, _, key in keys]


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _read_umask() -> int:
    mask = os.umask(0)  # the only portable way to read it: set and restore, once, at import (before any thread)
    os.umask(mask)
    return mask


UMASK = _read_umask()


@contextlib.contextmanager
def atomic_path(final: str | Path, is_dir: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `final`; rename it to `final` only if the block succeeds.

    A folder gets the stage's marker (`outputs.MARKER`) and replaces an existing `final` only if that one carries
    the marker too (or is empty): a stage never deletes a folder it did not write, whatever a config value names.
    """
    final = Path(final)
    if is_dir and (final.exists() or final.is_symlink()):
        check_replaceable(final, str(final))  # before the work, too: nothing is computed for an output refused
    final.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{final.name}.tmp-"
    if is_dir:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=final.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, dir=final.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        # mkstemp/mkdtemp create 0600/0700 (private temporaries); a final output gets what open() would
        # give it under the user's umask, so the group can read metrics and reports on a shared cluster
        tmp.chmod((0o777 if is_dir else 0o666) & ~UMASK)
        if is_dir:
            mark(tmp, final)
        yield tmp
        if is_dir:  # what a library wrote inside (safetensors: 0600) gets the umask's mode too: a server under
            for f in tmp.rglob("*"):  # another user must read an export
                f.chmod((0o777 if f.is_dir() else 0o666) & ~UMASK)
        if is_dir and (final.exists() or final.is_symlink()):
            shutil.rmtree(check_replaceable(final, str(final)))  # again: it may have appeared meanwhile
        os.replace(tmp, final)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
        raise


def save_dataset(ds: Any, final: str | Path, extra_json: dict[str, Any] | None = None) -> None:
    """Save a `datasets.Dataset` atomically, with a fingerprint derived from its content.

    An in-memory dataset gets a random fingerprint, which `save_to_disk` writes into state.json; the
    same rows would then hash differently for DVC on every run and invalidate every later stage.
    """
    h = hashlib.sha256()
    for table in ds.data.to_batches():
        for col in table.columns:
            h.update(str(col.to_pylist()).encode())
    ds._fingerprint = h.hexdigest()[:16]
    with atomic_path(final, is_dir=True) as tmp:
        ds.save_to_disk(str(tmp))
        for name, obj in (extra_json or {}).items():  # renamed together with the data, never apart
            (tmp / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def config_hash(obj: Any) -> str:
    """A short stable hash of a JSON-able config: what decides an output's content."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def has_stamp(folder: str | Path, stamp: str) -> bool:
    """Whether `folder` was written under this config hash (its FINGERPRINT file): resume or start afresh."""
    marker = Path(folder) / "FINGERPRINT"
    return marker.exists() and marker.read_text().strip() == stamp


def write_json(path: str | Path, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def remove_stale_temporaries(folder: str | Path) -> int:
    """Delete temporaries that a killed run left behind (they never carry a final name)."""
    folder = Path(folder)
    if not folder.is_dir():
        return 0
    n = 0
    for p in folder.glob(".*.tmp-*"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        n += 1
    return n
