"""evaluation/contention.py: the share of our CPUs other processes used while a measurement ran, which the evaluate
stage records beside its speed-ups and the report flags."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from specdistill.evaluation import contention
from specdistill.evaluation.contention import Contention


def test_the_share_is_others_busy_seconds_over_the_cpus_wall_seconds():
    readings = iter([(100.0, 10.0, 0.0), (103.0, 11.0, 2.0)])  # (busy, own, clock) at start and stop
    now = {}

    def busy(cpus):
        now.update(zip(("busy", "own", "t"), next(readings), strict=True))
        return now["busy"]

    c = Contention(busy=busy, own=lambda: now["own"], clock=lambda: now["t"])
    c.cpus = {0, 1}
    # 3 busy CPU-seconds in 2 s on 2 CPUs, 1 of them ours: others used 2 of 4
    assert c.start().stop() == 0.5
    unreadable = Contention(busy=lambda cpus: None)
    assert unreadable.start().stop() is None  # no /proc/stat: not measured, not zero


def test_our_own_work_is_not_counted_and_cpus_others_keep_busy_are(tmp_path):
    """Real processes, on whatever else the machine runs: our own spinning is left out of the share, and the share
    holds at least what spinners on every CPU used."""
    import resource

    if contention.cpus_busy_seconds({0}) is None:
        pytest.skip("no /proc/stat here")
    c = Contention()
    wall = lambda t0: (time.monotonic() - t0) * len(c.cpus)  # noqa: E731 (CPU-seconds of the window)
    own0, t0 = contention.own_cpu_seconds(), time.monotonic()
    c.start()
    while time.monotonic() - t0 < 1.0:  # one CPU busy with our own work
        pass
    mine, own = c.stop(), (contention.own_cpu_seconds() - own0) / wall(t0)
    assert mine <= 1 - own + 0.05, (mine, own)  # what we used is not others'
    spin = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 2.0: pass\n"
    kids0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    c.start()
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in c.cpus]
    for p in procs:
        p.wait()
    theirs, kids = c.stop(), resource.getrusage(resource.RUSAGE_CHILDREN)
    spun = (kids.ru_utime + kids.ru_stime - kids0.ru_utime - kids0.ru_stime) / wall(t0)
    assert spun > 0.05 and theirs >= spun - 0.05, (theirs, spun)  # at least the spinners' CPU time


def test_a_reaped_child_counts_as_ours_where_the_work_runs_in_one(tmp_path):
    """The serve stage's engine runs in its worker, a child: with own_and_children_cpu_seconds its CPU time is ours
    once the child is waited for, so the share says what others took, not what the engine did. Both readings over
    the same window: the tree's share is the process's alone less the child's."""
    if contention.cpus_busy_seconds({0}) is None:
        pytest.skip("no /proc/stat here")
    spin = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 1.5: pass\n"
    alone, tree = Contention(own=contention.own_cpu_seconds), Contention(own=contention.own_and_children_cpu_seconds)
    t0, before = time.monotonic(), contention.own_and_children_cpu_seconds()
    alone.start(), tree.start()
    subprocess.run([sys.executable, "-c", spin], check=True)
    without, with_child = alone.stop(), tree.stop()
    child = (contention.own_and_children_cpu_seconds() - before) / ((time.monotonic() - t0) * len(alone.cpus))
    assert child > 0.2 and without >= child - 0.05, (without, with_child, child)  # RUSAGE_SELF: the child is others'
    assert with_child == pytest.approx(max(0.0, without - child), abs=0.05), (without, with_child, child)


def test_the_engines_bound_cores_are_the_ones_measured():
    """serve.threads binds the engine to some cores (VLLM_CPU_OMP_THREADS_BIND): the share is over those, so a
    process on one of them counts in full and one on another core does not."""
    from specdistill.evaluation.contention import cpu_list

    assert cpu_list("0-1") == {0, 1} and cpu_list("0,2,4-5") == {0, 2, 4, 5} and cpu_list("0-1|2-3") == {0, 1, 2, 3}
    assert cpu_list(None) is None and cpu_list("auto") is None and cpu_list("nobind") is None
    allowed = Contention().cpus
    one = min(allowed)
    assert Contention(cpus={one}).cpus == {one}
    assert Contention(cpus={max(allowed) + 64}).cpus == allowed  # cores this process may not use: all of its own
