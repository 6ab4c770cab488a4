"""Runs INSIDE the engine's virtualenv (`.venv-engine`): speculators' own trainer (`speculators train`, the package
unedited) on a CPU, for exactly the optimizer steps asked, timed. stdlib + torch + speculators.

    python launch.py --steps S --record run.json [--without SHIM] -- <speculators train arguments>

- the CPU shims (shims.py) are applied first (`--without` leaves one out: the test that each is still needed);
- `--max-steps` in speculators 0.9 ends the epoch it falls in, and each later epoch then runs one more step, so the
  epochs are set here from speculators' own packing sampler on the same data and seed: the run ends at step S
  exactly (`--epochs`, `--max-steps` and `--train-data-ratio` are this script's to set);
- `--record` gets what the run did: its steps, the tokens packed into them, the seconds of the whole run and of its
  training steps (tokens/s from these), the process's peak resident memory, speculators' version and the last
  epoch's folder.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # shims.py beside this file; no specdistill install here

import shims  # noqa: E402
import torch  # noqa: E402


def schedule(data_path: str, ratio: float, total_seq_len: int, seed: int, steps: int) -> tuple[int, int]:
    """(epochs, tokens) that `steps` optimizer steps take: the batches speculators' packing sampler makes, epoch by
    epoch, on the training rows (the first int(len * ratio)), each batch's tokens capped at total_seq_len."""
    import numpy as np
    from datasets import load_from_disk
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = load_from_disk(data_path).with_format(None)["seq_len"]
    lengths = np.asarray(lengths[:int(len(lengths) * ratio)])
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=lengths, num_replicas=1,
                                                 rank=0, seed=seed)
    clipped = np.minimum(lengths, total_seq_len)
    done = tokens = epochs = 0
    while done < steps:
        batches = sampler._generate_batches(epochs)  # what set_epoch(epochs) + iter yields
        if not batches:
            raise SystemExit(f"speculators' sampler packs no batch from {len(lengths)} rows of {data_path}")
        for batch in batches[:steps - done]:
            tokens += min(int(clipped[batch].sum()), total_seq_len)
        done += min(len(batches), steps - done)
        epochs += 1
    return epochs, tokens


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, required=True, help="optimizer steps, exactly")
    ap.add_argument("--train-ratio", type=float, required=True, help="the rows that train (the rest validate)")
    ap.add_argument("--record", required=True, help="where the run's figures go (JSON)")
    ap.add_argument("--without", action="append", default=[], choices=sorted(shims.SHIMS),
                    help="leave this CPU shim out (the test that it is still needed)")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="-- then speculators train's own arguments")
    args = ap.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    for own in ("--epochs", "--max-steps", "--train-data-ratio"):
        if own in rest:
            raise SystemExit(f"{own} is set by launch.py from --steps (exact steps): do not pass it")
    shims.apply([n for n in shims.SHIMS if n not in args.without])

    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    def value(flag: str, default: str) -> str:
        return rest[rest.index(flag) + 1] if flag in rest else default

    epochs, tokens = schedule(value("--data-path", "."), args.train_ratio, int(value("--total-seq-len", "8192")),
                              int(value("--seed", "42")), args.steps)
    cfg = TrainConfig.resolve([*rest, "--epochs", str(epochs), "--max-steps", str(args.steps),
                               "--train-data-ratio", repr(args.train_ratio)])
    save = Path(value("--save-path", "."))
    resumed = any(p.name.isdigit() for p in save.iterdir()) if save.is_dir() else False
    timed = timer()
    start = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - start
    from importlib.metadata import version

    loop = timed["s"]
    record = {"steps": args.steps, "epochs": epochs, "tokens": tokens, "wall_s": round(wall, 2),
              # a resumed run's steps were not all this process's: no rate from it
              "train_s": round(loop, 2), "tokens_per_s": round(tokens / loop, 2) if loop > 0 and not resumed else None,
              "resumed": resumed,
              "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
              "speculators": version("speculators"), "torch": torch.__version__,
              "checkpoint": str(save / str(epochs - 1)), "argv": rest}
    Path(args.record).write_text(json.dumps(record, indent=1))
    return record


def timer() -> dict:
    """The seconds of `Trainer.train_epoch` (the training steps and their batches' loading), apart from the start,
    the validation passes and the epoch checkpoints, as our train record times its steps (training/throughput.py)."""
    import speculators.train.trainer as trainer

    timed = {"s": 0.0}
    run = trainer.Trainer.train_epoch

    def timed_run(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return run(self, *args, **kwargs)
        finally:
            timed["s"] += time.perf_counter() - start

    trainer.Trainer.train_epoch = timed_run
    return timed


if __name__ == "__main__":
    main()
    sys.exit(0)
