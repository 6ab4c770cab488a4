"""The package's import graph: no module reaches itself through its imports (top-level or inside functions)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports() -> dict[str, set[str]]:
    """{module: the package modules it imports anywhere in its body} (`from a import b` counts a.b when a.b is a
    module, else a)."""
    mods = {module_name(p): p for p in (SRC / "specdistill").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        out = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                for a in node.names:
                    full = f"{base}.{a.name}"
                    out.add(full if full in mods else base)
        graph[name] = {m for m in out if m in mods and m != name}
    return graph


def test_no_module_imports_itself_through_others():
    graph = imports()
    assert "specdistill.core.data.features" in graph and "specdistill.stages.train" in graph
    cycles = []
    for start in graph:  # depth-first from each module: a path back to it is a circle
        stack, seen = [(start, (start,))], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join((*path, start)))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, (*path, nxt)))
    # a package's __init__ importing its own modules is how a registry registers them: not a circle unless a
    # module imports its package back
    assert not cycles, "\n".join(sorted(set(cycles))[:20])


def method_modules(graph: dict[str, set[str]]) -> set[str]:
    """A method's own modules: the registered methods' modules under methods/, and the models/decoding/training/
    export modules named after a registered method (models.eagle, decoding.medusa, training.draft, export.eagle3,
    models.draft_lm, models.medusa_tree, ...)."""
    from specdistill import methods

    names = set(methods.all_methods())
    own = {m for m in graph if m.startswith("specdistill.methods.") and not m.endswith(".registry")}
    layers = ("models", "decoding", "training", "export")
    return own | {m for m in graph if m.count(".") == 2 and m.split(".")[1] in layers
                  and any(m.rsplit(".", 1)[1].startswith(n) for n in names)}


def test_no_stage_imports_a_method_module():
    """Stages ask the registry (`specdistill.methods`), never a method's own modules: a new method needs no stage
    edit. Found by this test when it was written: evaluate (EAGLE's tree config), features (EAGLE's default
    layers) and train (the draft LM's size)."""
    graph = imports()
    own = method_modules(graph)
    assert {"specdistill.methods.eagle", "specdistill.methods.eagle.model", "specdistill.methods.draft.training",
            "specdistill.methods.eagle.export", "specdistill.methods.medusa.proposer"} <= own
    offenders = sorted(f"{stage} imports {m}" for stage in graph if stage.startswith("specdistill.stages.")
                       for m in graph[stage] & own)
    assert not offenders, "\n".join(offenders)


def test_the_stages_that_train_nothing_do_not_import_the_training_stack():
    """evaluate, export, serve and report start without Lightning and torchmetrics (a few seconds a process, paid by
    every one of their DVC items): a method's config lives in its method module, its Lightning module is imported
    only when it trains."""
    import subprocess
    import sys

    code = ("import sys; import specdistill.stages.evaluate, specdistill.stages.export, specdistill.stages.serve, "
            "specdistill.stages.report; print(sorted(m for m in ('lightning', 'torchmetrics') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
