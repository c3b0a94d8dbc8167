"""Run a module (as `python -m` would) under cProfile timed by its main thread's CPU, writing stats on exit.

On shared CPUs a wall-clock profile charges a function for the time its process waited for a CPU;
CPU time charges only what ran. The main thread is the event loop, where a service's per-token
Python runs; grpc's own threads are left out.

    python -m bench.profile_module OUT.prof gateway --port 50051 ...
"""
from __future__ import annotations

import cProfile
import runpy
import sys
import time


def main() -> None:
    out, module, *args = sys.argv[1:]
    sys.argv = [module, *args]
    profile = cProfile.Profile(time.thread_time)
    try:
        profile.runcall(runpy.run_module, module, run_name="__main__", alter_sys=True)
    finally:
        profile.dump_stats(out)


if __name__ == "__main__":
    main()
