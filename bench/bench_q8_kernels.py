"""The matmul kernels alone: one decode step's 28 layers of Qwen3-0.6B-shaped weights, bf16 against int8 and fp8.

Streams the layers' four matmuls (qkv, o, gate_up, down) 28 times over, with random weights, at a few
row counts, each format's kernel as the engine routes it (bf16: the AVX512-BF16 kernel to 2 rows,
AMX above; 8-bit with bf16 activations (--no-int8-activations for int8): the AVX-512 widening kernel to 4
rows, AMX over dequantized blocks above). int8a8 is the same int8 weights with the activations quantized
to int8 per row, as the engine runs int8 by default (w8a8_linear.c): AMX-INT8 tiles at every row count
(without AMX-INT8: AVX512-VNNI to 4 rows, the widening kernels above); --a8-vnni puts 1-4 rows on VNNI
even where AMX-INT8 is there, to compare the two.
Interleaved (bf16, int8, int8a8, fp8 in each round); medians of the rounds, in ms per step. The vocab
projection is left out.

    python -m bench.bench_q8_kernels --threads 2 --rows 1,16
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.model_worker.kernels import cpu_linear, cpu_q8_linear  # noqa: E402

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)] * 28  # (out, in): qkv, o, gate_up, down


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--a8-vnni", action="store_true", help="int8a8 at 1-4 rows on the VNNI kernel")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    q8, small, amx = cpu_q8_linear.load(), cpu_linear.load(), cpu_linear.load_amx()
    if q8 is None or small is None:
        sys.exit("the kernels need a CPU with AVX512-BF16 and a C compiler")
    gen = torch.Generator().manual_seed(0)
    bf16 = [torch.randn(n, k, generator=gen).bfloat16() for n, k in SHAPES]
    int8 = [(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, 1, generator=gen), k)
            for n, k in SHAPES]
    fp8 = [(torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn), torch.rand(n, -(-k // 128), generator=gen), 128)
           for n, k in SHAPES]

    def step(kind: str, m: int, xs: dict) -> float:
        start = time.perf_counter()
        for i, (_, k) in enumerate(SHAPES):
            x = xs[k]
            if kind == "bf16":
                if m <= 2 or amx is None:
                    cpu_linear.small_batch_linear(small, x, bf16[i])
                else:
                    cpu_linear.amx_linear(amx, x, bf16[i])
            elif kind == "int8a8":
                w, s, _ = int8[i]
                if m <= 4 and q8.w8a8_vnni and (args.a8_vnni or not q8.w8a8_amx):
                    cpu_q8_linear.w8a8_linear(q8, x, w, s, amx=False)
                elif q8.w8a8_amx:
                    cpu_q8_linear.w8a8_linear(q8, x, w, s, amx=True)
                else:
                    cpu_q8_linear.linear(q8, x, w, s, k, amx=q8.amx and m > 4)
            else:
                w, s, bk = (int8 if kind == "int8" else fp8)[i]
                cpu_q8_linear.linear(q8, x, w, s, bk, amx=q8.amx and m > 4)
        return (time.perf_counter() - start) * 1e3

    print(f"{args.threads} threads, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on "
          f"{os.cpu_count()} CPUs; ms per step of 28 layers (median, min-max of {args.repeats} rounds)")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in (1024, 2048, 3072)}
        times = {kind: [] for kind in ("bf16", "int8", "int8a8", "fp8")}
        for _ in range(args.repeats):
            for kind in times:
                times[kind].append(step(kind, m, xs))
        cells = "  ".join(f"{kind} {statistics.median(t):7.1f} ({min(t):.1f}-{max(t):.1f})" for kind, t in times.items())
        ratios = "  ".join(f"{kind}/bf16 time {statistics.median(a / b for a, b in zip(times[kind], times['bf16'])):.2f}"
                           for kind in ("int8", "int8a8", "fp8"))
        print(f"{m:3d} rows: {cells}   {ratios}", flush=True)


if __name__ == "__main__":
    main()
