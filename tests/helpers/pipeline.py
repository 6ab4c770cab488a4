"""dvc.yaml as DVC itself resolves it over the committed params.yaml: every item (`stage@key` for a foreach stage) with
its command, its dependency paths and the params it watches. The tests read the pipeline through DVC, not by
re-implementing its templating."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Item:
    name: str
    cmd: str
    deps: tuple[str, ...]
    params: tuple[str, ...]


@cache
def items() -> dict[str, Item]:
    from dvc.repo import Repo

    out = {}
    with Repo(str(ROOT)) as repo:
        for stage in repo.index.stages:
            paths = tuple(d.def_path for d in stage.deps if not hasattr(d, "params"))
            params = tuple(p for d in stage.deps if hasattr(d, "params") for p in (d.params or []))
            out[stage.addressing] = Item(stage.addressing, stage.cmd, paths, params)
    return out
