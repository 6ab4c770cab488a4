"""dvc.yaml's deps cover the code each stage runs: a stage that imports a module DVC does not watch
would keep stale outputs after that module changes. Imports are followed statically (ast), so
the check costs no model and no import side effects."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
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
        elif isinstance(node, ast.ImportFrom) and node.level > 0:  # relative: resolve against the file
            package = path.relative_to(SRC).with_suffix("").parts
            package = package[: len(package) - node.level + (1 if path.name == "__init__.py" else 0)]
            module = ".".join(package + ((node.module,) if node.module else ()))
            found.add(module)
            found |= {f"{module}.{a.name}" for a in node.names if _module_file(f"{module}.{a.name}")}
    return found


def _closure(script: Path) -> set[Path]:
    """Every src file a pipeline script reaches, parents' `__init__.py` included."""
    seen: set[Path] = set()
    todo = [script, ROOT / "pipelines" / "_entry.py"]
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


def _stages() -> list[tuple[str, Path, list[str]]]:
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    out = []
    for name, stage in spec.items():
        body = stage.get("do", stage)
        script = next(w for w in body["cmd"].split() if w.startswith("pipelines/"))
        deps = [d if isinstance(d, str) else next(iter(d)) for d in body["deps"]]
        out.append((name, ROOT / script, deps))
    return out


STAGES = _stages()


@pytest.mark.parametrize(("stage", "script", "deps"), STAGES, ids=[s[0] for s in STAGES])
def test_deps_cover_imported_code(stage: str, script: Path, deps: list[str]) -> None:
    assert str(script.relative_to(ROOT)) in deps, f"{stage}: its own script is not a dep"
    missing = []
    for file in sorted(_closure(script)):
        rel = file.relative_to(ROOT).as_posix()
        if rel.endswith("__init__.py") and file.stat().st_size == 0:
            continue  # an empty package marker changes no output
        if any(rel == d or rel.startswith(d.rstrip("/") + "/") for d in deps):
            continue
        missing.append(rel)
    assert not missing, f"stage {stage} imports files dvc.yaml does not list as deps: {missing}"
