"""Stage `train@M`: see `specdistill.stages.train`. `python pipelines/train.py --help` lists the config.

Sweeps: `python pipelines/train.py -m draft=xs,s,m loss=fkl,rkl,jsd,tvd` (one W&B run per job, one group).
Each method's draft size, loss and optimizer are under `methods.<m>` (conf/methods/<m>.yaml); here
`draft=`, `loss=` and `optimizer=` are shorthand for `draft@methods.<m>.draft=`, ... of the method(s) that
`method=` names (conf/config.yaml's `method` when it names none).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from _entry import ROOT, stage_main

from specdistill.stages.train import Job, run

GROUPS = ("draft", "loss", "optimizer")  # config groups each method chooses for itself


def method_groups(argv: list[str]) -> list[str]:
    """`loss=fkl` -> `loss@methods.<m>.loss=fkl` for every method `method=` names (a sweep `method=a,b` too);
    `draft=` only for the methods that size a draft (whose defaults choose one)."""
    given = [a.split("=", 1)[1] for a in argv if a.startswith("method=")]
    chosen = given[-1].split(",") if given else [yaml.safe_load((ROOT / "conf/config.yaml").read_text())["method"]]
    out: list[str] = []
    if len(chosen) > 1 and any(a.partition("=")[0] in GROUPS for a in argv):
        raise SystemExit(f"error: method={','.join(chosen)} with a shorthand {'/'.join(GROUPS)}=: name each method's "
                         "own, e.g. loss@methods.draft.loss=fkl,tvd (a shorthand per method would multiply the jobs)")
    for arg in argv:
        group, _, value = arg.partition("=")
        if group not in GROUPS or not value or arg.startswith("-"):
            out.append(arg)
            continue
        takers = [m for m in chosen if group in _chosen_groups(m)]
        if not takers:
            raise SystemExit(f"error: {arg}: method={','.join(chosen)} has no `{group}` choice "
                             f"(only methods whose conf/methods/ file chooses one in its defaults)")
        out += [f"{group}@methods.{m}.{group}={value}" for m in takers]
    return out


def _chosen_groups(method: str, seen: tuple[str, ...] = ()) -> set[str]:
    """The config groups conf/methods/<method>.yaml chooses in its defaults, its parents' (`- draft`) included."""
    path = ROOT / "conf" / "methods" / f"{method}.yaml"
    if not path.exists() or method in seen:
        return set()
    groups: set[str] = set()
    for entry in (yaml.safe_load(path.read_text()) or {}).get("defaults", []):
        if isinstance(entry, str) and entry != "_self_":
            groups |= _chosen_groups(entry, (*seen, method))
        elif isinstance(entry, dict):
            for k in entry:
                groups.add(k.replace("override ", "").lstrip("/").split("@")[0])
    return groups


def multirun_job() -> Job | None:
    """In a Hydra multirun, this job: its folder, its value of every swept override and its number (None in a
    single run: DVC stages, hand runs). The swept keys come from the sweep's own record (`multirun.yaml`,
    written before any job starts, whichever launcher runs them)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    record = Path(hc.sweep.dir) / "multirun.yaml"
    given = yaml.safe_load(record.read_text())["hydra"]["overrides"]["task"] if record.exists() else []
    parser = OverridesParser.create()
    swept = {o.key_or_group for o in parser.parse_overrides(given) if o.is_sweep_override()}
    values = tuple(f"{_short(o.key_or_group)}={o.value()}" for o in parser.parse_overrides(list(hc.overrides.task))
                   if o.key_or_group in swept)
    return Job(Path(hc.runtime.output_dir), values, hc.job.num)


def _short(key: str) -> str:
    """`loss@methods.draft.loss` -> `loss`: a job is named as the user swept it."""
    group, _, package = key.partition("@")
    return group if package.startswith("methods.") and package.endswith(f".{group}") else key


if __name__ == "__main__":
    stage_main(run, job=multirun_job, rewrite=method_groups)
