"""The project's checkout: where it is, and its stages' front doors (pipelines/<stage>.py)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def front_door(stage: str):
    """pipelines/<stage>.py as a module (its helpers, e.g. train's shorthand `method_groups`), without running it."""
    import importlib.util
    import sys

    name = f"_front_door_{stage}"
    if name not in sys.modules:
        sys.path.insert(0, str(ROOT / "pipelines"))  # its `from _entry import ...`
        spec = importlib.util.spec_from_file_location(name, ROOT / "pipelines" / f"{stage}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
