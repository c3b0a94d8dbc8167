"""The matmul kernels alone: one decode step's 28 layers of Qwen3-0.6B-shaped weights, bf16 against int8 and fp8.

Streams the layers' four matmuls (qkv, o, gate_up, down) 28 times over, with random weights, at a few
row counts, each format's kernel as the engine routes it. bf16: vnni_linear.c on weights in VNNI order
where it builds (the engine's default), else the AVX512-BF16 kernel to 2 rows and AMX above. 8-bit with
bf16 activations (--no-int8-activations for int8): the AVX-512 widening kernel to 4 rows (16 without AMX),
AMX over dequantized blocks above. int8a8 is the same int8 weights with the activations quantized to int8
per row, as the engine runs int8 by default (w8a8_linear.c): AMX-INT8 tiles at every row count, or without
AMX-INT8 AVX512-VNNI register tiles on the weights packed once (pack_int8_vnni), at every row count too;
--a8-vnni puts int8a8 on VNNI even where AMX-INT8 is there, to compare the two.
Interleaved (bf16, int8, int8a8, fp8 in each round); medians of the rounds in ms per step, the weight bytes
read a second (GB/s: what bounds a decode step) and the multiply-adds done (GFLOP/s: what bounds a prompt),
and the median of per-round time ratios against bf16. The vocab projection is left out.

    taskset -c 0,1 python -m bench.bench_q8_kernels --threads 2 --rows 1,4,16,128
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
from services.model_worker.model.layers.quant.quantize import pack_int8_vnni  # noqa: E402

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)] * 28  # (out, in): qkv, o, gate_up, down


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--a8-vnni", action="store_true", help="int8a8 on the VNNI kernel where AMX-INT8 is there too")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    q8, small, amx, vnni = cpu_q8_linear.load(), cpu_linear.load(), cpu_linear.load_amx(), cpu_linear.load_vnni()
    if q8 is None or small is None:
        sys.exit("the kernels need a CPU with AVX512-BF16 and a C compiler")
    a8_amx = q8.w8a8_amx and not args.a8_vnni
    if not (a8_amx or q8.w8a8_vnni):
        sys.exit("int8a8 needs AMX-INT8 or AVX512-VNNI")
    gen = torch.Generator().manual_seed(0)
    bf16 = [torch.randn(n, k, generator=gen).bfloat16() for n, k in SHAPES]
    if vnni is not None:
        bf16 = [cpu_linear.vnni_pack_(vnni, w) for w in bf16]
    int8 = [(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, 1, generator=gen), k)
            for n, k in SHAPES]
    int8a8 = [(w if a8_amx else pack_int8_vnni(w), s) for w, s, _ in int8]
    fp8 = [(torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn), torch.rand(n, -(-k // 128), generator=gen), 128)
           for n, k in SHAPES]
    small_max = 4 if q8.amx else 16

    def step(kind: str, m: int, xs: dict) -> float:
        start = time.perf_counter()
        for i, (_, k) in enumerate(SHAPES):
            x = xs[k]
            if kind == "bf16":
                if vnni is not None:
                    cpu_linear.vnni_linear(vnni, x, bf16[i])
                elif m <= 2 or amx is None:
                    cpu_linear.small_batch_linear(small, x, bf16[i])
                else:
                    cpu_linear.amx_linear(amx, x, bf16[i])
            elif kind == "int8a8":
                cpu_q8_linear.w8a8_linear(q8, x, *int8a8[i], amx=a8_amx)
            else:
                w, s, bk = (int8 if kind == "int8" else fp8)[i]
                if m <= small_max or q8.amx:
                    cpu_q8_linear.linear(q8, x, w, s, bk, amx=q8.amx and m > 4)
                else:
                    torch.nn.functional.linear(x, cpu_q8_linear.dequantize(q8, w, s, bk))
        return (time.perf_counter() - start) * 1e3

    weights = sum(n * k for n, k in SHAPES)
    print(f"{args.threads} threads, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on "
          f"{os.cpu_count()} CPUs; int8a8 on {'AMX-INT8' if a8_amx else 'AVX512-VNNI'}; ms per step of 28 layers "
          f"(median, min-max of {args.repeats} rounds), GB/s of weights, GFLOP/s")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in (1024, 2048, 3072)}
        times = {kind: [] for kind in ("bf16", "int8", "int8a8", "fp8")}
        for r in range(args.repeats):
            for kind in (list(times) if r % 2 == 0 else list(times)[::-1]):
                times[kind].append(step(kind, m, xs))
        for kind, t in times.items():
            ms = statistics.median(t)
            ratio = statistics.median(a / b for a, b in zip(t, times["bf16"]))
            print(f"{m:4d} rows {kind:6s} {ms:8.2f} ms ({min(t):.1f}-{max(t):.1f})  "
                  f"{weights * (2 if kind == 'bf16' else 1) / ms / 1e6:6.1f} GB/s  "
                  f"{2 * m * weights / ms / 1e6:7.1f} GFLOP/s  time/bf16 {ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()
