"""The docs cannot drift from the config: every `key=value` override the README and docs/ show (a whole code span such
as `eval.k=4`, or a word of a command that runs a pipeline script, `dvc exp run` or `make ... OVERRIDES=`) names a key
that the composed config has, or a config group and one of its options."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from omegaconf import OmegaConf

from .helpers.config import composed

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
OVERRIDE = re.compile(r"^[+~]?([a-z_][\w]*(?:[.@/][\w]+)*)=(\S+)$")
COMMAND = re.compile(r"pipelines/\w+\.py|dvc exp run|OVERRIDES=")


@functools.cache
def top_keys() -> frozenset[str]:
    """The composed config's top-level keys, its groups and `hydra`: what an override may start with. Composed once
    for every page (a composition costs about a second on a slow CPU)."""
    return frozenset(set(composed()) | {p.name for p in (ROOT / "conf").iterdir() if p.is_dir()} | {"hydra"})


def overrides(text: str) -> list[str]:
    """The overrides a page shows: whole code spans that set a config key, and the words of the commands in its
    code (a placeholder such as `experiment=<name>` is no override). A command continued over lines (`\\`) counts as
    one."""
    tops = top_keys()
    found = [s for s in re.findall(r"`([^`\n]+)`", text)
             if OVERRIDE.match(s) and re.split(r"[.@/]", OVERRIDE.match(s).group(1))[0] in tops]
    code = (re.findall(r"```.*?```", text, re.S) + re.findall(r"`([^`\n]+)`", text)
            + ["\n".join(re.findall(r"^(?: {4}|\t)(.*)$", text, re.M))])  # indented code blocks
    for block in code:
        for line in re.sub(r"\\\n", " ", block).splitlines():
            if COMMAND.search(line):
                words = [w.strip("'\"()") for w in line.split("#")[0].split()]
                found += [w.removeprefix("-S").lstrip("=") for w in words
                          if OVERRIDE.match(w) and not w.startswith(("--", "OVERRIDES"))]
    return [o for o in found if "<" not in o]


def problem(override: str, cfg: dict) -> str | None:
    """None when the override's key exists in the composed config `cfg`; for a group option, a key of the hydra
    section or a `+`/`~` key, when Hydra composes it (each value of a sweep). Else what is wrong."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    key, values = OVERRIDE.match(override).group(1).lstrip("+~"), override.split("=", 1)[1]
    prefix = override[: len(override) - len(override.lstrip("+~"))]
    group = "@" in key or "/" in key or (ROOT / "conf" / key).is_dir()
    if not group and not prefix and not key.startswith("hydra"):
        known = key == "method" or OmegaConf.select(OmegaConf.create(cfg), key, default="<no>") != "<no>"
        return None if known else f"no key {key} in the composed config"
    # a group's options (the train front door also takes draft= and loss=, which the root config has not)
    if (ROOT / "conf" / key).is_dir() and not prefix and not key.startswith("hydra"):
        missing = [v for v in values.split(",") if not (ROOT / "conf" / key / f"{v}.yaml").exists()]
        return f"no option {missing} in conf/{key}" if missing else None
    extra = ["hydra/launcher=slurm"] if key.startswith("hydra.launcher.") else []
    for value in ([values] if values[0] in "[{'\"" or "(" in values else values.split(",")):
        try:
            with initialize_config_dir(str(ROOT / "conf"), version_base=None):
                compose(config_name="config", overrides=[*extra, f"{prefix}{key}={value}"],
                        return_hydra_config=key.startswith("hydra"))
        except HydraException as e:  # an option a group does not have, a key the hydra section does not take
            return str(e).splitlines()[0]
    return None


def shown() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), o) for p in DOCS for o in overrides(p.read_text())]


def test_the_pages_show_overrides():
    assert len(shown()) > 40  # the extraction finds what the pages show


def test_every_override_shown_names_a_key_that_exists():
    cfg, pages = composed(), shown()
    why = {o: problem(o, cfg) for o in {o for _, o in pages}}  # each override checked once, however many pages show it
    wrong = [f"{page}: `{o}`: {why[o]}" for page, o in pages if why[o]]
    assert not wrong, "\n".join(wrong)


def test_the_readme_explains_and_points():
    """At most 250 lines: the how-to; the measurements live in reports/ and docs/findings.md."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_a_key_that_does_not_exist_is_named():
    cfg = composed()
    assert problem("eval.lookup_branch=true", cfg) == "no key eval.lookup_branch in the composed config"
    assert problem("loss@methods.eagle.loss=nope", cfg) is not None
    assert problem("hydra.launcher.nope=1", cfg) is not None
    assert overrides("run `python pipelines/evaluate.py eval.k=4 experiment=<name>` and `decode.eagle.path=x`") == [
        "decode.eagle.path=x", "eval.k=4"]
