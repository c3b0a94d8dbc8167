"""The grouped expert kernel alone (kernels/moe.c): one MoE layer of Qwen3-30B-A3B's shape, bf16 against int8 and fp8.

Random experts (hidden 2048, expert size 768, top 8; --experts of them, 128 in the real model, fewer to
fit a small machine: only the chosen 8 a token are read either way), a decode step's tokens routed at
random, each format's C entry as the engine calls it for steps of up to 32 tokens. Interleaved (bf16,
int8, fp8 in each round, a fresh routing each round); medians of the rounds in ms per layer, and the
ratios to bf16 (the median of the per-round ratios).

    python -m bench.bench_moe_q8 --threads 1 --tokens 1,4 --experts 32
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.model_worker.kernels import cpu_moe  # noqa: E402
from services.model_worker.model.layers.quant.quantize import quantize_fp8_blocks, quantize_int8  # noqa: E402

HIDDEN, INTERMEDIATE, TOP_K = 2048, 768, 8


def quantize(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(E, N, K) bf16 to 8 bits as the engine holds them: (q, one row of scales per weight row, block)."""
    qs, scales = [], []
    for expert in weight:
        if fmt == "int8":
            q, s = quantize_int8(expert)
        else:
            q, s = quantize_fp8_blocks(expert)
            s = s.repeat_interleave(128, 0)[:expert.shape[0]]
        qs.append(q)
        scales.append(s)
    return torch.stack(qs).contiguous(), torch.stack(scales).contiguous(), 128 if fmt == "fp8" else weight.shape[2]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    library = cpu_moe.load()
    if library is None:
        sys.exit("the mixture-of-experts C kernel needs a C compiler")
    gen = torch.Generator().manual_seed(0)
    e = args.experts
    w13 = (torch.randn(e, 2 * INTERMEDIATE, HIDDEN, generator=gen) / HIDDEN ** 0.5).bfloat16()
    w2 = (torch.randn(e, HIDDEN, INTERMEDIATE, generator=gen) / INTERMEDIATE ** 0.5).bfloat16()
    q8 = {fmt: (quantize(w13, fmt), quantize(w2, fmt)) for fmt in ("int8", "fp8")}
    print(f"{e} experts, hidden {HIDDEN}, expert size {INTERMEDIATE}, top {TOP_K}, {args.threads} thread(s); "
          f"bytes a chosen expert: bf16 {2 * 3 * HIDDEN * INTERMEDIATE / 1e6:.1f} MB, 8-bit "
          f"{3 * HIDDEN * INTERMEDIATE / 1e6:.1f} MB")
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, HIDDEN, generator=gen).bfloat16()
        times = {"bf16": [], "int8": [], "fp8": []}
        for _ in range(args.rounds):
            ids = torch.stack([torch.randperm(e, generator=gen)[:TOP_K] for _ in range(tokens)])
            weights = torch.softmax(torch.randn(tokens, TOP_K, generator=gen), -1)
            for fmt in times:
                start = time.perf_counter()
                if fmt == "bf16":
                    cpu_moe.moe_experts(library, x, w13, w2, weights, ids)
                else:
                    (a, sa, ba), (b, sb, bb) = q8[fmt]
                    cpu_moe.moe_experts_q8(library, x, a, sa, ba, b, sb, bb, weights, ids)
                times[fmt].append((time.perf_counter() - start) * 1e3)
        medians = {fmt: statistics.median(v) for fmt, v in times.items()}
        ratios = {fmt: statistics.median(a / b for a, b in zip(times[fmt], times["bf16"])) for fmt in ("int8", "fp8")}
        print(f"{tokens} token(s): " + ", ".join(
            f"{fmt} {m:.2f} ms ({min(times[fmt]):.2f}-{max(times[fmt]):.2f})" for fmt, m in medians.items())
            + "; time / bf16: " + ", ".join(f"{fmt} {r:.2f}" for fmt, r in ratios.items()))


if __name__ == "__main__":
    main()
