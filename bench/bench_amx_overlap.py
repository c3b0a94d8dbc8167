"""Whether the AMX tile products of a prefill matmul overlap with streaming weights from memory, on one
CPU: the measurement behind what is left of a 128-token prefill's time (docs/peers.md, "What is left").

A C loop (bench/amx_overlap.c) runs steps of the VNNI kernel's 2 x 2 tile products, four 1 KB tile loads
each, with the operands cycling through buffers that sit in L1 (16 KB each) or L2 (256 KB of inputs,
64 KB of weights), beside N prefetches a step of fresh lines from a 1 GB buffer into L2. At 128 rows the
kernel's weights arrive at 512 bytes a step on average (8 lines): if the stream ran beside the products,
a step would take the longer of the two; if it took its turn, their sum. The configurations take turns,
each round; prints the best round of each in ns per step, then one JSON line. Pin it to one CPU:
    taskset -c 1 python -m bench.bench_amx_overlap

`--watch N` instead samples, every half second for N seconds, the products with both operands in L1 and
a loop of AVX512-BF16 dot products on registers: how the tile unit's speed moves on this machine, beside
the vector units'.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from services.model_worker.kernels import build  # noqa: E402

SOURCE = pathlib.Path(__file__).with_name("amx_overlap.c")
KB = 1024
# Where the products' operands sit: (input bytes, weight bytes).
OPERANDS = {"none": None, "both in L1": (16 * KB, 16 * KB), "inputs in L2": (256 * KB, 16 * KB),
            "both in L2": (256 * KB, 64 * KB)}


def watch(library, seconds: float) -> None:
    """Every half second: the L1 tile products' ns per step and eight vector dot products' ns per round."""
    library.avx512_step_ns.argtypes = [ctypes.c_int64]
    library.avx512_step_ns.restype = ctypes.c_double
    amx, avx = [], []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        amx.append(library.amx_overlap_step_ns(16 * KB, 16 * KB, 0, 1, 200_000))
        avx.append(library.avx512_step_ns(2_000_000))
        print(f"tile products {amx[-1]:6.1f} ns/step   vector dot products {avx[-1]:5.2f} ns/round", flush=True)
        time.sleep(0.5)
    for name, v in (("tile products", amx), ("vector dot products", avx)):
        print(f"{name}: min {min(v):.2f}  median {statistics.median(v):.2f}  max {max(v):.2f}  "
              f"(max/min {max(v) / min(v):.2f}, {len(v)} samples)")
    print(json.dumps({"bench": "amx_overlap_watch", "samples": len(amx), "tile_ns": amx, "vector_ns": avx}))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", default="0,4,8,12", help="prefetched lines a step")
    parser.add_argument("--steps", type=int, default=500_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--watch", type=float, default=0, help="seconds of sampling both units' speed instead")
    args = parser.parse_args(argv)
    library = build.load(SOURCE, "AMX overlap")
    if library is None:
        raise SystemExit("bench/amx_overlap.c does not build here")
    run = library.amx_overlap_step_ns
    run.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    run.restype = ctypes.c_double
    if args.watch:
        watch(library, args.watch)
        return
    lines = [int(n) for n in args.lines.split(",") if n]
    cases = [(where, n) for where in OPERANDS for n in lines if OPERANDS[where] or n]
    best = {case: float("inf") for case in cases}
    for r in range(args.rounds):
        for i in range(len(cases)):
            where, n = case = cases[(i + r) % len(cases)]
            a, b = OPERANDS[where] or (16 * KB, 16 * KB)
            ns = run(a, b, n, OPERANDS[where] is not None, args.steps)
            if ns < 0:
                raise SystemExit("no AMX here (or Linux refused the tile state)")
            best[case] = min(best[case], ns)
    print(f"{'products':14s}" + "".join(f"{f'{n} lines':>11s}" for n in lines))
    for where in OPERANDS:
        print(f"{where if OPERANDS[where] else 'stream alone':14s}"
              + "".join(f"{best[(where, n)]:11.1f}" if (where, n) in best else f"{'-':>11s}" for n in lines))
    print(json.dumps({"bench": "amx_overlap", "rounds": args.rounds, "steps": args.steps,
                      "ns_per_step": {f"{where}/{n}": ns for (where, n), ns in best.items()}}))


if __name__ == "__main__":
    main()
