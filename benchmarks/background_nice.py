"""Does `nice` keep a background job off a measurement? A fixed workload on every core, timed alone, then beside a
job started as long runs are (`setsid nice -n 19 ...`: a session of its own), then with that job's autogroup niced.

Linux with `sched_autogroup_enabled` (most distributions' default) shares the CPUs between sessions first and applies
a process's nice only inside its own session, so a `nice -n 19` job in another session still takes its share;
`echo 19 > /proc/<pid>/autogroup` (or running it from the same session) makes it yield. docs/findings.md, "A niced
background job".

    python benchmarks/background_nice.py [--threads N] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

BURN = ("import torch; torch.set_num_threads({n}); a = torch.randn(1024, 1024, dtype=torch.bfloat16)\n"
        "while True: a @ a")


def probe(threads: int, repeats: int, matmuls: int = 300) -> float:
    """Median seconds for `matmuls` bf16 1024x1024 products on `threads` threads."""
    torch.set_num_threads(threads)
    a = torch.randn(1024, 1024, dtype=torch.bfloat16)
    for _ in range(5):
        a @ a
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(matmuls):
            a @ a
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def autogroup_enabled() -> bool | None:
    p = Path("/proc/sys/kernel/sched_autogroup_enabled")
    return p.read_text().strip() == "1" if p.exists() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of the probe and of the job "
                    "(default: every core)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    print(f"sched_autogroup_enabled: {autogroup_enabled()}  cores: {os.cpu_count()}  threads: {args.threads}")
    rows = [("alone", probe(args.threads, args.repeats))]
    job = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", BURN.format(n=args.threads)],
                           start_new_session=True)
    try:
        time.sleep(2)
        rows.append(("beside `setsid nice -n 19` job", probe(args.threads, args.repeats)))
        group = Path(f"/proc/{job.pid}/autogroup")
        if group.exists():
            group.write_text("19")  # the session's weight, not the process's
            time.sleep(1)
            rows.append(("... its autogroup niced to 19", probe(args.threads, args.repeats)))
    finally:
        job.kill()
        job.wait()
    base = rows[0][1]
    print("| probe | seconds | x alone |\n|---|---|---|")
    for name, s in rows:
        print(f"| {name} | {s:.2f} | {s / base:.2f} |")


if __name__ == "__main__":
    main()
