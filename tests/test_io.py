"""io.atomic_path: an output appears whole under its final name, with the permissions open() would give it."""

from __future__ import annotations

import stat

import pytest

from specdistill.io import UMASK, atomic_path, write_json


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
