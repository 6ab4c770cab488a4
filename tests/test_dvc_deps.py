"""dvc.yaml's deps cover the code each item runs: an item that imports a module DVC does not watch would keep stale
outputs after that module changes. Imports are followed statically (ast), from the pipeline script and from the
method folders the item lists (a stage loads its method by name, which no import statement shows), so the check
costs no model and no import side effects."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from .helpers.pipeline import ROOT, items

SRC = ROOT / "src"


def _module_file(name: str) -> Path | None:
    base = SRC.joinpath(*name.split("."))
    if (base / "__init__.py").exists():
        return base / "__init__.py"
    if base.with_suffix(".py").exists():
        return base.with_suffix(".py")
    return None


def _imports(path: Path) -> set[str]:
    """`specdistill.*` modules one file imports, including `from pkg import submodule`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("specdistill")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("specdistill"):
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names if _module_file(f"{node.module}.{a.name}")}
    return found


def _closure(start: list[Path]) -> set[Path]:
    """Every src file the start files reach, parents' `__init__.py` included."""
    seen: set[Path] = set()
    todo = list(start)
    while todo:
        path = todo.pop()
        for name in _imports(path):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__ and a/b/__init__ too
                file = _module_file(".".join(parts[:i]))
                if file is not None and file not in seen:
                    seen.add(file)
                    todo.append(file)
    return seen


def _docstring_only(file: Path) -> bool:
    """A file that runs nothing but its docstring (a package marker) changes no output."""
    body = ast.parse(file.read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


ITEMS = items()


@pytest.mark.parametrize("item", sorted(ITEMS))
def test_deps_cover_imported_code(item: str) -> None:
    spec = ITEMS[item]
    script = ROOT / next(w for w in spec.cmd.split() if w.startswith("pipelines/"))
    assert str(script.relative_to(ROOT)) in spec.deps, f"{item}: its own script is not a dep"
    method_code = [f for d in spec.deps if d.startswith("src/specdistill/methods/") and (ROOT / d).is_dir()
                   for f in sorted((ROOT / d).glob("*.py"))]
    missing = []
    for file in sorted(_closure([script, ROOT / "pipelines/_entry.py", *method_code])):
        rel = file.relative_to(ROOT).as_posix()
        if rel.endswith("__init__.py") and _docstring_only(file):
            continue
        if any(rel == d or rel.startswith(d.rstrip("/") + "/") for d in spec.deps):
            continue
        missing.append(rel)
    assert not missing, f"{item} imports files dvc.yaml does not list as deps: {missing}"


def test_an_edit_to_one_methods_folder_touches_its_items_only():
    """What `dvc status` shows after an edit inside methods/medusa/: Medusa's items (and the report, which describes
    every method), and no other method's."""
    touched = {name for name, spec in ITEMS.items()
               if any("src/specdistill/methods/medusa/tree.py".startswith(d.rstrip("/") + "/") for d in spec.deps)}
    assert touched == {"train@medusa", "evaluate@medusa", "export@medusa", "serve@medusa", "report"}, touched


def test_dvc_yaml_is_short_and_names_no_item():
    """Written from conf: each foreach stage iterates its section of params.yaml and takes its item's inputs from
    it; code deps are folders. Only the head to head (`compare`, four models) names its items."""
    text = (ROOT / "dvc.yaml").read_text()
    lines = text.splitlines()
    assert len(lines) <= 300, len(lines)  # 249 when written from conf; reference added 17, online_engine 29
    assert sum("src/" in line for line in lines) <= 90  # online_engine: 13 of them
    compare = re.search(r"\n  compare:.*?\n\n", text, re.S).group(0)
    code = "\n".join(line.split("#")[0] for line in text.replace(compare, "\n").splitlines())
    named = {key for item in ITEMS for key in item.split("@")[1:]}
    # as a path, a dotted key or a mapping key (a word such as "draft" in a label is no item)
    pattern = lambda k: rf"[/.@]{k}\b(?!\.py)|^\s*-?\s*{k}:"  # noqa: E731
    assert not [k for k in named if re.search(pattern(k), code, re.M)], \
        sorted(k for k in named if re.search(pattern(k), code, re.M))


def test_no_shared_folder_holds_a_file_named_after_a_method():
    from specdistill import methods

    names = set(methods.all_methods()) | {p.stem for p in (ROOT / "conf/methods").glob("*.yaml")}
    for folder in ("core/models", "core/data", "training", "decoding", "export", "reporting", "evaluation"):
        stems = {p.stem for p in (SRC / "specdistill" / folder).glob("*.py")}
        assert not {s for s in stems for n in names if s == n or s.startswith(n + "_")}, (folder, stems & names)
