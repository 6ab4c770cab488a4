"""Where a `dvc repro` spends its time: minutes per stage, per foreach stage and in all, for an experiment run from
scratch in a temporary copy of the checkout (the checkout's own outputs and dvc.lock stay as they are).

    python benchmarks/repro_times.py [--experiment smoke] [--set KEY=VALUE ...] [--dir /tmp/repro] [--keep] [TARGET ...]

The copy is what tests/test_smoke.py runs: the project's files, no outputs, the fetched assets (`make assets`).
W&B is off. Needs `make engine` for the engine's stages. Prints the machine's kind beside the table: on a CPU
without native bf16 every multi-token forward costs several times more (`target.dtype=auto` takes float32 there).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from specdistill.core.hardware import cpu_name, matrix_units  # noqa: E402
from tests.helpers.checkout import minutes_table, repro_checkout, repro_env, timed_repro  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--experiment", default="smoke", help="conf/experiment/<name> (default: smoke)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="Hydra overrides for compose.py")
    ap.add_argument("--dir", type=Path, default=None, help="where to make the copy (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the copy (its outputs, dvc.lock and repro.log)")
    ap.add_argument("targets", nargs="*", help="stage items to run (and what they need); default: every one")
    ap.add_argument("--timeout", type=float, default=4 * 3600, help="seconds before the repro is killed")
    args = ap.parse_args()

    base = args.dir or Path(tempfile.mkdtemp(prefix="repro-"))
    if (base / "proj").exists():
        sys.exit(f"{base / 'proj'} exists: pass another --dir or remove it")
    proj = repro_checkout(base / "proj")
    env = repro_env(require_engine=False)  # without `make engine` the engine's stages say so themselves
    subprocess.run([sys.executable, "pipelines/compose.py", f"experiment={args.experiment}", *args.set], cwd=proj,
                   env=env, check=True)
    print(f"dvc repro of {args.experiment} in {proj} on {cpu_name()} (bf16 units: {matrix_units() or 'none'})",
          flush=True)
    code, out, minutes = timed_repro(proj, env, args.timeout,
                                     lambda stage, at: print(f"{at:7.2f} min  {stage}", flush=True),
                                     targets=args.targets)
    print(minutes_table(minutes))
    if code:
        print(out[-4000:], file=sys.stderr)
    if args.keep or code:
        (proj / "repro.log").write_text(out)
        print(f"kept {proj} (repro.log has dvc's output)")
    else:
        shutil.rmtree(base if args.dir is None else base / "proj")
    sys.exit(code)


if __name__ == "__main__":
    main()
