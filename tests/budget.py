"""`make test` in its parts, each timed: the fast tests, the lossless suite, the engine's tests and the smoke run,
then a table of wall minutes per part and the CPU kind, so every CI log says where its time went.

    python tests/budget.py [--full] [PYTEST_ARGS ...]

Every part runs even when one before it failed (a log shows every failure at once); the exit status is the first
failing part's. `--full` is `make test-full`: the heavier tier in each part (pytest --full). SPECDISTILL_INSTALL_S
(seconds), set by `.ci/run` around `make setup assets engine`, adds the installs' row.

The budget (issue "A test suite that fits its budget"): `make test` from a fresh clone, installs included, within
40 minutes on a 2-core AVX2 CPU and 25 on one with bf16 units (AMX, AVX512-BF16); CI stops a run at 90.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from specdistill.core.hardware import cpu_name, matrix_units  # noqa: E402

# (part, its marker expression): together every test, each once
PARTS = (
    ("fast tests", "not lossless and not engine"),
    ("lossless", "lossless"),
    ("engine", "engine and not smoke"),
    ("smoke", "smoke"),
)
BUDGET_MIN = {"bf16 units": 25.0, "no bf16 units": 40.0}


def main(argv: list[str]) -> int:
    extra = list(argv)
    rows: list[tuple[str, float, str]] = []
    if os.environ.get("SPECDISTILL_INSTALL_S"):
        rows.append(("installs", float(os.environ["SPECDISTILL_INSTALL_S"]) / 60, "ok"))
    status = 0
    for part, marks in PARTS:
        print(f"\n=== {part}: pytest -m '{marks}' {' '.join(extra)}", flush=True)
        start = time.perf_counter()
        code = subprocess.call([sys.executable, "-m", "pytest", "-m", marks, *extra], cwd=ROOT)
        # 5: nothing collected (a part empty under the arguments given) is not a failure
        ok = code in (0, 5)
        rows.append((part, (time.perf_counter() - start) / 60, "ok" if ok else f"FAILED ({code})"))
        status = status or (0 if ok else code)
    units = matrix_units()
    kind = "bf16 units" if units else "no bf16 units"
    total = sum(m for _, m, _ in rows)
    print(f"\nWall minutes per part on {cpu_name()} ({os.cpu_count()} CPUs; bf16 units: {units or 'none'}):")
    print(f"| {'part':<10} | {'minutes':>7} | result |\n|{'-' * 12}|{'-' * 9}|--------|")
    for part, minutes, result in rows:
        print(f"| {part:<10} | {minutes:7.1f} | {result} |")
    budget = "the heavier tier: no budget" if "--full" in extra else f"budget {BUDGET_MIN[kind]:.0f} min ({kind})"
    print(f"| {'total':<10} | {total:7.1f} | {budget} |")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
