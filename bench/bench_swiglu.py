"""The MLP's gate/up matmul and its activation, F.silu(gate) * up, on the CPU: oneDNN and torch's ops (F.linear
on the plain weight, then F.silu and the product), the VNNI kernel then the C activation (vnni_linear and
decoder.c's silu_and_mul, two passes), and the VNNI kernel with the activation applied to its result tiles
(vnni_linear_silu, one pass: what the engine runs on AMX). The three give the same bits.

Over the 28 layers of Qwen3-0.6B's gate/up shape (random weights, streamed from memory as in a step), the
paths taking turns layer by layer in one process; prints the best round of each per row count and the median
over rounds of its time over the two-pass path's in the same round, then one JSON line. Pin it to one CPU
for the engine's one-CPU placement:
    taskset -c 1 python -m bench.bench_swiglu --threads 1 --rows 32,128,512,768
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from bench.bench_prefill_matmul import time_in_turns
from services.model_worker.kernels import cpu_decoder, cpu_linear

HIDDEN, INTERMEDIATE, LAYERS = 1024, 3072, 28


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="32,128,512,768")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    vnni, act = cpu_linear.load_vnni(), cpu_decoder.load()
    if vnni is None or act is None:
        raise SystemExit("the VNNI kernels do not run here (need AMX-BF16 and a C compiler)")
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.02).bfloat16() for _ in range(LAYERS)]
    in_vnni_order = {id(w): cpu_linear.vnni_pack_(vnni, w.clone()) for w in weights}

    def torch_ops(x, w):
        gate, up = F.linear(x, w).chunk(2, dim=-1)
        return F.silu(gate) * up

    paths = {
        "onednn_torch": torch_ops,
        "vnni_two_passes": lambda x, w: cpu_decoder.silu_and_mul(act, cpu_linear.vnni_linear(vnni, x, in_vnni_order[id(w)])),
        "vnni_fused": lambda x, w: cpu_linear.vnni_linear_silu(vnni, x, in_vnni_order[id(w)]),
    }
    results = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        x = torch.randn(rows, HIDDEN, generator=gen).bfloat16()
        expected = paths["vnni_two_passes"](x, weights[0])
        assert torch.equal(paths["vnni_fused"](x, weights[0]), expected)
        # Each path on another layer's weight in turn, so each still streams it from memory.
        times = time_in_turns(list(paths), weights, args.rounds, lambda name, w: paths[name](x, w))
        best = {name: min(t) for name, t in times.items()}
        ratio = {name: statistics.median(a / b for a, b in zip(t, times["vnni_two_passes"]))
                 for name, t in times.items()}
        results[rows] = {name: {"ms": best[name] * 1e3, "vs_two_passes": ratio[name]} for name in paths}
        print(f"{rows:4d} rows: " + "  ".join(f"{name} {best[name] * 1e3:7.1f} ms ({ratio[name]:.2f}x)"
                                            for name in paths), flush=True)
    print(json.dumps({"bench": "swiglu", "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
