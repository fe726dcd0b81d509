"""The machine's load around a timed sample, so a reader can tell a speed measured on a busy machine.

With torch's threads equal to the cores, one other busy process made a SmolLM2 decode step 40–50× slower here
(issue 30). Around every timed sample the runner takes a `LoadProbe` and records its `load` (SampleRecord.load):

    interval_s                      seconds between the two readings (the sample's decoding, a little more)
    loadavg_before, loadavg_after   os.getloadavg()'s 1-minute figure (every runnable thread, ours included; it lags)
    busy_cores                      mean busy CPUs over the interval, of those this process may run on (/proc/stat;
                                    None off Linux)
    own_cores                       this process's CPU seconds (all its threads) ÷ interval_s
    cores, torch_threads            the CPUs this process may run on, and torch's intra-op threads

Judging it (other processes' CPUs against the free cores = cores − torch threads) is records.overloaded: the rule
lives with the record contract, so every reader judges old and new records alike.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

PROC_STAT = Path("/proc/stat")


def allowed_cpus() -> set[int]:
    """The logical CPUs this process may run on (a container or taskset may allow fewer than the host has)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def cpu_times(stat_text: str, cpus: set[int]) -> tuple[int, int] | None:
    """(busy, total) clock ticks summed over `cpus` from /proc/stat's per-CPU lines. Busy = user + nice + system +
    irq + softirq + steal (steal: the hypervisor gave the CPU to another guest); idle + iowait are not busy."""
    busy = total = 0
    for line in stat_text.splitlines():
        name, *ticks = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        user, nice, system, idle, iowait, irq, softirq, steal = (list(map(int, ticks)) + [0] * 8)[:8]
        busy += user + nice + system + irq + softirq + steal
        total += user + nice + system + idle + iowait + irq + softirq + steal
    return (busy, total) if total else None


def busy_cores(before: tuple[int, int] | None, after: tuple[int, int] | None, cores: int) -> float | None:
    """Mean busy CPUs between two cpu_times readings (None: unreadable, or no clock tick passed)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * cores


def _read_cpu_times(cpus: set[int]) -> tuple[int, int] | None:
    try:
        return cpu_times(PROC_STAT.read_text(), cpus)
    except OSError:
        return None


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


class LoadProbe:
    """`with LoadProbe() as probe: <timed sample>`, then `probe.load` (the dict above). Its readings are taken
    outside the engine's timed region (a file read and two clocks: microseconds)."""

    def __enter__(self) -> LoadProbe:
        self.cpus = allowed_cpus()
        self.loadavg_before = _loadavg()
        self.ticks_before = _read_cpu_times(self.cpus)
        self.own_before = time.process_time()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        interval = time.perf_counter() - self.t0
        own = time.process_time() - self.own_before
        ticks = _read_cpu_times(self.cpus)
        self.load = {
            "interval_s": interval,
            "loadavg_before": self.loadavg_before,
            "loadavg_after": _loadavg(),
            "busy_cores": busy_cores(self.ticks_before, ticks, len(self.cpus)),
            "own_cores": own / interval if interval > 0 else None,
            "cores": len(self.cpus),
            "torch_threads": torch.get_num_threads(),
        }
