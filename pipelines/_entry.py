"""The shared front door: Hydra composes the config, the stage's library `run(cfg)` does the work.

Run by hand, a script composes `conf/` (so `-m` sweeps work); under DVC it reads the composed
`params.yaml` with `--config-dir . --config-name params`, so `dvc exp run -S ...` changes what runs.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # runs from a plain checkout too

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from specdistill.core.config import register_resolvers  # noqa: E402
from specdistill.core.records import code_version  # noqa: E402
from specdistill.core.stage import check_globals, setup_logging  # noqa: E402

register_resolvers()  # conf/'s `${files_stamp:...}` when a stage composes conf/ itself (run by hand)


def stage_main(run: Callable[..., Any], job: Callable[[], Any] | None = None,
               rewrite: Callable[[list[str]], list[str]] | None = None) -> None:
    """Run a stage's `run(cfg)` under Hydra. `job`: called inside each job, its result passed as `run(cfg,
    job=...)` (what a multirun job is: the stage needs no Hydra of its own); `rewrite`: the stage's shorthand
    overrides, turned into Hydra's before it parses them."""
    @hydra.main(version_base="1.3", config_path=str(ROOT / "conf"), config_name="config")
    def _main(cfg: DictConfig) -> None:
        setup_logging()
        code_version()  # the code this stage starts with, which its record names (read now, not hours later)
        container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
        check_globals(container)
        run(container, job=job()) if job else run(container)

    stage = Path(sys.argv[0]).stem
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(stage_help(stage, run))
        sys.exit(0)
    _check_config_file(sys.argv[1:])
    if rewrite is not None:
        sys.argv[1:] = rewrite(sys.argv[1:])
    if not any(a.startswith("hydra.job.name=") for a in sys.argv[1:]):
        # logs and Hydra's app name: the stage, not `_entry`. Hydra's parser takes the overrides as one run of
        # words anywhere among its flags: join the user's run (`-m a=1 --cfg hydra`), never split it
        at = next((i for i, a in enumerate(sys.argv) if i and "=" in a and not a.startswith("-")), len(sys.argv))
        sys.argv.insert(at, f"hydra.job.name={stage}")
    _main()


def stage_help(stage: str, run: Callable[..., Any]) -> str:
    """What the stage does (its module's docstring), what it reads and writes (its dvc.yaml entry), the config
    groups to choose from, and how to see the whole config."""
    import yaml

    doc = (sys.modules[run.__module__].__doc__ or "").strip()
    spec = (yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"] or {}).get(stage, {})
    body, items = spec.get("do", spec), spec.get("foreach") or []
    if isinstance(items, str):  # `${methods}`: one item per key of that section of params.yaml
        section = yaml.safe_load((ROOT / "params.yaml").read_text()) if (ROOT / "params.yaml").exists() else {}
        for part in items.strip("${}").split("."):
            section = (section or {}).get(part) or {}
        items = section
    items = list(items)
    def shown(path: Any) -> str:  # `${item.needs}` -> `<needs>`, `${experiment_name}` -> `<experiment_name>`
        return re.sub(r"\$\{(?:item\.)?([^}]+)\}", r"<\1>", str(path))

    reads = [shown(d) for d in body.get("deps", []) if not str(d).startswith(("src/", "pipelines/"))]
    writes = [shown(next(iter(o)) if isinstance(o, dict) else o) for key in ("outs", "metrics", "plots")
              for o in body.get(key, [])]
    groups = sorted(p.name for p in (ROOT / "conf").iterdir() if p.is_dir())
    options = {g: sorted(f.stem for f in (ROOT / "conf" / g).glob("*.yaml")) for g in groups}
    lines = [doc if doc.startswith(stage) else f"{stage}: {doc}", ""]
    if items:
        lines += [f"DVC runs it once per item: {', '.join(f'{stage}@{i}' for i in items)} (<key> below; each item's "
                  "inputs are in its conf entry)", ""]
    lines += ["Reads:  " + (", ".join(map(str, reads)) or "the config only"),
              "Writes: " + (", ".join(map(str, writes)) or "-"), "",
              "Config groups (choose with group=option; every key can be set with key=value):"]
    lines += [f"  {g:<12} {' | '.join(o) or '-'}" for g, o in options.items()]
    lines += ["", "Usage:",
              f"  python pipelines/{stage}.py [group=option ...] [key=value ...]     run it by hand (composes conf/)",
              f"  python pipelines/{stage}.py -m key=a,b                            a sweep (one job per value)",
              f"  python pipelines/{stage}.py --cfg job                              print the whole composed config",
              f"  python pipelines/{stage}.py --config-dir . --config-name params    how DVC runs it (params.yaml)",
              "  --hydra-help                                                   Hydra's own options"]
    return "\n".join(lines)


def _check_config_file(argv: list[str]) -> None:
    """`--config-dir D --config-name N` (how DVC runs a stage) with no D/N.yaml: say how to make it, not
    Hydra's "Cannot find primary config"."""
    def value(flag: str) -> str | None:
        for i, arg in enumerate(argv):
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
        return None

    folder, name = value("--config-dir") or value("-cd"), value("--config-name") or value("-cn")
    if folder is None or name is None:
        return
    path = Path(folder) / (name if name.endswith(".yaml") else f"{name}.yaml")
    if not path.exists():
        hint = ("compose it from conf/ with `make params` (or `python pipelines/compose.py`), or run "
                "`dvc exp run`, which composes it") if name in ("params", "params.yaml") else "check the name"
        sys.exit(f"error: the config {path} does not exist: {hint}")
