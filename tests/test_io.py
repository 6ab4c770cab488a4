"""io.atomic_path: an output appears whole under its final name, with the permissions open() would give it."""

from __future__ import annotations

import stat

import pytest

from specdistill.core.io import UMASK, atomic_path, write_json


def test_outputs_get_the_umask_permissions_not_the_temporaries(tmp_path):
    write_json(tmp_path / "m.json", {"a": 1})  # mkstemp would leave it 0600: unreadable to the group
    with atomic_path(tmp_path / "d", is_dir=True) as tmp:
        (tmp / "x").write_text("x")
    assert stat.S_IMODE((tmp_path / "m.json").stat().st_mode) == 0o666 & ~UMASK
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o777 & ~UMASK


def test_a_failed_block_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "m.json") as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_sha256_cached_reads_a_file_once_and_keeps_one_entry_per_path(tmp_path, monkeypatch):
    """A file's hash is kept across processes under its stat (the target's weights are not read again each stage);
    an edited file is read again and its old entry dropped, so the store does not grow with edits."""
    import hashlib
    import json
    import os

    from specdistill.core import io

    monkeypatch.setenv("SPECDISTILL_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 100)
    reads = []
    real = io.sha256_file
    monkeypatch.setattr(io, "sha256_file", lambda p: reads.append(p) or real(p))
    assert io.sha256_cached(f) == hashlib.sha256(b"a" * 100).hexdigest()
    assert io.sha256_cached(f) == hashlib.sha256(b"a" * 100).hexdigest() and len(reads) == 1  # from the store
    st = f.stat()
    f.write_bytes(b"b" * 100)  # same size; a new mtime
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert io.sha256_cached(f) == hashlib.sha256(b"b" * 100).hexdigest() and len(reads) == 2
    store = json.loads((tmp_path / "cache/file_sha256.json").read_text())
    assert list(store.values()) == [hashlib.sha256(b"b" * 100).hexdigest()]
    gone = tmp_path / "gone.bin"  # a file that is deleted leaves the store at the next write
    gone.write_bytes(b"c")
    io.sha256_cached(gone)
    gone.unlink()
    g = tmp_path / "g.bin"
    g.write_bytes(b"d")
    io.sha256_cached(g)
    store = json.loads((tmp_path / "cache/file_sha256.json").read_text())
    assert sorted(k.rsplit("|", 3)[0] for k in store) == sorted(str(x.resolve()) for x in (f, g))
    monkeypatch.setenv("SPECDISTILL_CACHE", "off")  # nothing kept: read each time
    io.sha256_cached(f), io.sha256_cached(f)
    assert len(reads) == 6
