"""The CPUs the engine core runs on (--engine-cpus), apart from the ones the serving processes use.

On a CPU host the engine's OpenMP threads fill every core they are given. The worker's gRPC front,
the gateway and the tokenizer then take their CPU time per token out of the engine's step (measured
in docs/http-api.md). Giving the engine core a set of CPUs of its own, and leaving the others to
those processes, is the same split vLLM's CPU backend makes with VLLM_CPU_OMP_THREADS_BIND.

The core process is started with the set already applied, so everything in it sees the set from its
first instruction: torch sizes its thread pool by it, OpenMP starts its threads inside it, and the
tensor-parallel ranks the core starts inherit it. The worker's own threads move to the CPUs left
over: the OS would otherwise place them on the engine's CPUs whenever the others are busy, and every
such placement preempts the engine's step.
"""
from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPUs written as Linux writes them: '3', '0-3', '0,2,4-7'. Raises ValueError, saying why."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list: give CPU numbers and ranges, such as 1 or 0-3 or 0,2-3")
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise ValueError(f"{text!r} is not a CPU list: the range {part} runs backwards")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def check_available(cpus: frozenset[int]) -> None:
    """Raise ValueError if this process may not run on every one of `cpus` (absent, offline, or outside its cgroup)."""
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError("CPU affinity needs Linux")
    allowed = os.sched_getaffinity(0)
    missing = sorted(cpus - allowed)
    if missing:
        raise ValueError(f"CPU {', '.join(map(str, missing))} {'is' if len(missing) == 1 else 'are'} not available "
                         f"to this process (it may run on {format_cpu_list(allowed)})")


def format_cpu_list(cpus) -> str:
    """The shortest Linux-style list: {0, 1, 2, 5} -> '0-2,5'."""
    parts, ordered = [], sorted(cpus)
    start = prev = None
    for cpu in ordered + [None]:
        if cpu is not None and prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(parts)


def current() -> str:
    """The CPUs this thread may run on, as a list; 'any' where the OS does not say (not Linux)."""
    return format_cpu_list(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else "any"


def others(cpus: frozenset[int]) -> frozenset[int]:
    """The CPUs this thread may run on besides `cpus` (empty if `cpus` cover them all)."""
    return frozenset(os.sched_getaffinity(0) - cpus)


def keep_process_off(cpus: frozenset[int]) -> frozenset[int] | None:
    """Move every thread of this process to its other CPUs; None (nothing moved) if `cpus` are all it has.

    Threads started later inherit the set of the thread that starts them, so calling this before a
    server starts its threads covers them too; the threads already running are moved one by one.
    """
    rest = others(cpus)
    if not rest:
        return None
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), rest)
    return rest


@contextlib.contextmanager
def inherited_by_children(cpus: frozenset[int] | None) -> Iterator[None]:
    """Within the block, processes this thread starts run on `cpus` only (None: unchanged).

    A child inherits the affinity of the thread that forks it. Narrowing this thread's own set for
    the moment of the fork pins the child before it runs any code, with no hook in the child
    (subprocess's preexec_fn is unsafe in a process with threads, as a gRPC server is).
    """
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)  # 0: the calling thread, on Linux
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def main(argv=None) -> None:
    """`--others LIST`: print the CPUs besides LIST (empty line if none), for a script that starts the
    gateway and tokenizer with `taskset` off the engine core's CPUs."""
    parser = argparse.ArgumentParser(prog="python -m services.model_worker.host.cpu_affinity",
                                     description="CPU lists for --engine-cpus")
    parser.add_argument("--others", required=True, metavar="LIST",
                        help="print the CPUs this process may use besides LIST, such as 1 or 2-15")
    args = parser.parse_args(argv)
    try:
        cpus = parse_cpu_list(args.others)
        check_available(cpus)
    except ValueError as e:
        parser.error(str(e))
    print(format_cpu_list(others(cpus)))


if __name__ == "__main__":
    main()
