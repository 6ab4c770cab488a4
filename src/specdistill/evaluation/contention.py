"""What else ran on a measurement's CPUs: the share of their time that went to anything but this process.

A speed-up divides by an AR row of the same run, but a machine busy with other work slows the rows by different
amounts: beside a serving engine on the same cores the smoke run's compare decoded 5-25x slower, some rows far
more than others (docs/findings.md, "A busy machine does not slow every row alike"). The interval cannot show it
(it measures the noise between prompts within the run), so the share is recorded beside the figures.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from pathlib import Path

BUSY = 0.1  # others' share of our CPUs above which a run's timings are flagged (log and report)


def busy_warning(share: float | None, what: str = "this run") -> str | None:
    """The warning to print or log when others took more than BUSY of the CPUs while `what` measured, else None."""
    if share is None or share <= BUSY:
        return None
    return (f"other processes used {share:.0%} of the CPUs while {what} measured: its timings (speed-ups, an "
            "eval.depth=auto choice) are unreliable; rerun on a quiet machine")


def cpus_busy_seconds(cpus: set[int]) -> float | None:
    """Seconds the CPUs `cpus` have been busy since boot (Linux /proc/stat: user, nice, system, irq, softirq and
    steal, the hypervisor's share, which a VM's timings lose as well); None where it cannot be read."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if name[:3] == "cpu" and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
            ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK") if ticks else None


def own_cpu_seconds() -> float:
    """CPU seconds of this process (its threads); a child's work competes with it as any other process's does."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def own_and_children_cpu_seconds() -> float:
    """CPU seconds of this process and of the children it has waited for (and theirs): where the measured work runs
    in a child, as the serve stage's engine worker does, read it after the child is reaped. A child still running
    (W&B's service) is not counted yet, so it stays among the others; so does a grandchild its parent did not wait
    for (an engine core killed at shut-down with `serve.multiprocessing=true`): its time would read as others'."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own_cpu_seconds() + kids.ru_utime + kids.ru_stime


def busy_lines(shares: dict[str, float | None], runs: str = "runs") -> list[str]:
    """The report's lines on the machine's other work: the runs measured on a busy one, in bold, and for how many
    the share is recorded at all (silence is not "quiet": records written before it was measured carry none)."""
    lines = []
    if busy := {n: v for n, v in sorted(shares.items()) if busy_warning(v)}:
        lines += [f"**Measured on a busy machine: {', '.join(f'{n} ({v:.0%})' for n, v in busy.items())} of the "
                  "CPUs went to other processes during the run: its speed-ups are not to be trusted; rerun it on a "
                  "quiet machine.**", ""]
    if unknown := [n for n, v in shares.items() if v is None]:
        lines += [f"The CPU share other work took during the run is recorded for {len(shares) - len(unknown)} "
                  f"of {len(shares)} {runs} (records written before it was measured carry none).", ""]
    return lines


def cpu_list(spec: str | None) -> set[int] | None:
    """The CPUs a bind list names ("0-1", "0,2,4-7", vLLM's "0-31|32-63" for several ranks); None for none or a
    word ("auto", "nobind")."""
    if not spec:
        return None
    cpus: set[int] = set()
    try:
        for part in str(spec).replace("|", ",").split(","):
            lo, _, hi = part.strip().partition("-")
            cpus |= set(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        return None
    return cpus or None


class Contention:
    """Others' share of this process's CPUs over a window: (the CPUs' busy seconds less our own) / (wall seconds x
    CPUs). `start()`, then `stop()` returns it (None where /proc/stat is unreadable); `busy`, `own` and `clock` are
    injectable for tests."""

    def __init__(self, busy: Callable[[set[int]], float | None] = cpus_busy_seconds,
                 own: Callable[[], float] = own_cpu_seconds, clock: Callable[[], float] = time.monotonic,
                 cpus: set[int] | None = None):
        self.busy, self.own, self.clock = busy, own, clock
        allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        # the measured work's own cores where it is bound to some (the engine's VLLM_CPU_OMP_THREADS_BIND): others'
        # use of the rest does not slow it, and theirs on these is diluted by the rest's idle time
        self.cpus = ((cpus & allowed) or allowed) if cpus else allowed

    def start(self) -> Contention:
        self._at = (self.busy(self.cpus), self.own(), self.clock())
        return self

    def stop(self) -> float | None:
        busy0, own0, t0 = self._at
        busy, own, t = self.busy(self.cpus), self.own(), self.clock()
        if busy is None or busy0 is None or t <= t0:
            return None
        return round(max(0.0, ((busy - busy0) - (own - own0)) / ((t - t0) * len(self.cpus))), 3)
