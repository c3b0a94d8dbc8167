"""CPU seconds used by each service process (its children included) and by this process, from /proc.

Benchmarks on two cores are decided by who takes the CPU: a service's per-token cost shows here
even when its wall-clock effect is hidden in another process's slowdown.
"""
from __future__ import annotations

import os
import pathlib
import time

from tests.integration.stack import child_pids, thread_status

TICKS = os.sysconf("SC_CLK_TCK")


def process_tree_cpu(pid: int) -> float:
    """User + system seconds of `pid` and its living descendants (a child that exited is not counted)."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            fields = pathlib.Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / TICKS
        todo.extend(child_pids(current))
    return total


def preemptions(pid: int) -> int:
    """Times the threads of `pid` were switched out while still runnable (involuntary context switches).

    A compute process that is preempted waits while its CPU runs someone else: on shared CPUs this
    counts how often the serving processes got in the engine core's way.
    """
    return sum(int(n) for n in thread_status(pid, "nonvoluntary_ctxt_switches").values())


class CpuMeter:
    """CPU seconds per named process tree between `start()` and `stop()`, and this process's own as "client"."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self._before: dict[str, float] = {}

    def _read(self) -> dict[str, float]:
        return {**{name: process_tree_cpu(pid) for name, pid in self.pids.items()}, "client": time.process_time()}

    def start(self) -> None:
        self._before = self._read()

    def stop(self) -> dict[str, float]:
        after = self._read()
        return {name: after[name] - self._before[name] for name in after}
