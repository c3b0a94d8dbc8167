"""--nice: a service that passes tokens along yields the CPU to an engine core it shares CPUs with.

On a CPU host where the tokenizer and gateway run on the engine core's CPUs, the core's step is an
OpenMP team that needs every one of them at once: whenever a service takes one, the whole step waits
for it. At a lower priority the services run in the gaps the step leaves (its single-threaded parts,
the waits between its parallel regions), and tokens that arrive while one is held back go out together.
"""
from __future__ import annotations

import argparse
import logging
import os

from rpcserver.config import add_flag

log = logging.getLogger(__name__)

# nice(1)'s range for lowering a priority; raising one needs privileges a service should not ask for.
NICE_RANGE = ("--nice", 0, 19)


def add_nice_flag(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--nice", 0, "lower this service's CPU priority by N (as nice(1), 0-19). On a CPU host "
             "where it shares CPUs with a worker's engine core, 10 lets the engine's step run first; "
             "scripts/up.sh sets it when the engine has no CPUs of its own")


def lower_priority(increment: int) -> None:
    """Every thread of this process `increment` nice levels lower.

    Linux keeps a nice value per thread, and a new thread takes its creator's: so every thread that
    exists now is lowered (gRPC may have started some), and any started later inherits the value.
    """
    if increment <= 0:
        return
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except FileNotFoundError:  # not Linux: the call applies to the whole process
        threads = [0]
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
    log.info("CPU priority lowered by %d (nice %d)", increment, os.getpriority(os.PRIO_PROCESS, 0))
