"""What every stage run shares: logging set-up, output checks, limits across config sections."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from specdistill.core.errors import ConfigError  # noqa: F401 (re-exported: stages raise it)
from specdistill.core.outputs import (
    MARKER,
    OutputError,
    check_files,
    check_paths,
    check_replaceable,
    claim,
    lock_output,
    owner_text,
    plain_name,
)


def check_outputs(cfg: dict[str, Any], names: dict[str, Any] | None = None,
                  replaced: dict[str, Path] | None = None, fingerprinted: dict[str, Path] | None = None,
                  files: dict[str, Path | list[Path]] | None = None, locked: dict[str, Path] | None = None,
                  inputs: dict[str, str | Path | None] | None = None) -> None:
    """At a stage's start, before any model loads: the names that become paths are plain names, no `paths.*`
    folder is the project or above it, and every folder the stage will replace whole is one a stage wrote
    (`replaced`: the marker of `io.atomic_path`; `fingerprinted`: a resumable output's FINGERPRINT).
    `files`: output files (one or a list per key), checked to be writable (no folder in their place, no file where
    their folder goes).
    Every output named (and `locked`: outputs a stage only adds to) is then locked for the rest of the run
    (`outputs.lock_output`).
    `inputs`: what the stage reads besides `paths.*` (a draft's folder): no folder it replaces holds one or lies in one.
    Keys are the config keys to name in the error."""
    plain_name(cfg.get("experiment_name", "default"), "experiment_name")
    for key, value in (names or {}).items():
        plain_name(value, key)
    check_paths(cfg.get("paths") or {})
    for key, folder in [*(replaced or {}).items(), *(fingerprinted or {}).items()]:
        out = Path(folder).resolve()
        for source, read in (inputs or {}).items():
            if read is None:
                continue
            src = Path(read).resolve()
            if out == src or out in src.parents or src in out.parents:
                where = "is" if out == src else "holds" if out in src.parents else "lies inside"
                raise OutputError(f"the output folder {folder} (from `{key}`) {where} what `{source}={read}` reads: "
                                  f"the stage would replace what it reads. Choose another `{key}` or `{source}`")
    experiment = cfg.get("experiment_name", "default")
    for key, folder in (replaced or {}).items():  # the marker names the output, and a report its experiment too
        claim(folder, owner_text(key, experiment if key == "paths.reports_dir" else None))
        check_replaceable(folder, key, (MARKER,))
    for key, folder in (fingerprinted or {}).items():
        check_replaceable(folder, key, ("FINGERPRINT",))
    each_file = [(key, p) for key, v in (files or {}).items() for p in (v if isinstance(v, list) else [v])]
    for key, path in each_file:
        check_files({key: path})
    for key, path in [*(replaced or {}).items(), *(fingerprinted or {}).items(), *each_file, *(locked or {}).items()]:
        lock_output(path, key)  # held to the end of the run: a second run on the same output is refused


def check_globals(cfg: dict[str, Any]) -> None:
    """The top-level keys the sections interpolate (`generate.seed: ${seed}`), checked under their own name: a bad
    `seed=abc` was reported as the first section's key that read it."""
    seed = cfg.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ConfigError(f"`seed={seed!r}`: must be an integer >= 0 (every stage's seed is `${{seed}}`)")


def cross_limits(cfg: dict[str, Any]) -> None:
    """Limits that span two sections, checked on the whole config before any model loads (and by
    `pipelines/compose.py` when it writes params.yaml): a stage that needs more prompts than `prepare` keeps."""
    check_globals(cfg)
    data, online = cfg.get("data") or {}, cfg.get("online") or {}
    if online:
        key = {"code": "num_humaneval", "chat": "num_val"}.get(online.get("scenario"))
        have, need = data.get(key) if key else None, int(online.get("requests", 0)) + int(online.get("held_out", 0))
        if have is not None and need > int(have):
            raise ConfigError(f"online.requests + online.held_out = {need}, but data.{key} = {have} prompts "
                              f"are prepared for online.scenario={online.get('scenario')}: lower online.requests / "
                              f"online.held_out or raise data.{key}")


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    for noisy in ("httpx", "urllib3", "filelock", "datasets", "transformers.modeling_utils"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
