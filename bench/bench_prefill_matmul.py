"""The bf16 matmuls of a prefill chunk on the CPU: oneDNN (F.linear on the plain weights), oneDNN on
weights reordered once into its blocked layout (a second copy of every weight: what vLLM's CPU backend
holds instead of the plain ones), the AMX kernel reading the plain weights in place, and the AMX
kernel on weights reordered into VNNI order (vnni_linear.c, what the engine holds by default on AMX),
over the 28 layers of Qwen3-0.6B's shapes (random weights, streamed from memory as in a step).

Interleaved layer by layer in one process; prints the best round of each per row count, its GFLOP/s,
and the median over rounds of its time over oneDNN's in the same round. Run it pinned to one CPU for the engine's one-CPU placement:
    taskset -c 1 python -m bench.bench_prefill_matmul --threads 1 --rows 64,128,256,384,512
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from services.model_worker.kernels import cpu_linear

# (out, in) of qkv, o, gate_up and down in Qwen3-0.6B.
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]
LAYERS = 28


def time_in_turns(names: list[str], layers: list, rounds: int, run) -> dict[str, list[float]]:
    """Seconds each path spent per round, running run(name, layer) over every layer.

    Layer by layer, each path in turn on a different layer (so each still streams its weights from
    memory), the order shifting every layer and round: this machine's speed moves within a second, and
    a path timed over a whole round of layers met a different machine from the next path's."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        spent = dict.fromkeys(names, 0.0)
        for i in range(len(layers)):
            for j in range(len(names)):
                v = (i + j + r) % len(names)
                layer = layers[(i + v * len(layers) // len(names)) % len(layers)]
                start = time.perf_counter()
                run(names[v], layer)
                spent[names[v]] += time.perf_counter() - start
        for name in names:
            times[name].append(spent[name])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="64,128,256,384,512")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    amx, vnni = cpu_linear.load_amx(), cpu_linear.load_vnni()
    if vnni is None:
        raise SystemExit("the VNNI-order kernels do not run here (need AVX512-BF16 and a C compiler)")
    gen = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(n, k, generator=gen) * 0.02).bfloat16() for n, k in SHAPES] for _ in range(LAYERS)]
    reordered = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, 32) for layer in weights for w in layer}
    in_vnni_order = {id(w): cpu_linear.vnni_pack_(vnni, w.clone()) for layer in weights for w in layer}
    paths = {
        "onednn": lambda x, w: F.linear(x, w),
        "onednn_reordered": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, reordered[id(w)], None, "none", [], ""),
        "amx": lambda x, w: cpu_linear.amx_linear(amx, x, w),
        "vnni": lambda x, w: cpu_linear.vnni_linear(vnni, x, in_vnni_order[id(w)]),
    }
    if amx is None:  # a CPU without AMX: vnni_linear runs its AVX512-BF16 register tiles
        del paths["amx"]
    results = {}
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for _, k in SHAPES}
        reference = F.linear(xs[1024], weights[0][0])
        for name in set(paths) - {"onednn"}:  # the same products: they agree to rounding
            got = paths[name](xs[1024], weights[0][0])
            assert (got.float() - reference.float()).abs().max() <= 0.02 * reference.float().abs().max(), name
        times = time_in_turns(list(paths), weights, args.rounds,
                              lambda name, layer: [paths[name](xs[w.shape[1]], w) for w in layer])
        flops = 2 * rows * sum(n * k for n, k in SHAPES) * LAYERS
        best = {name: min(t) for name, t in times.items()}
        ratio = {name: statistics.median(a / b for a, b in zip(t, times["onednn"])) for name, t in times.items()}
        results[rows] = {name: {"ms": best[name] * 1e3, "gflops": flops / best[name] / 1e9,
                                "vs_onednn": ratio[name]} for name in paths}
        print(f"{rows:4d} rows: " + "  ".join(
            f"{name} {best[name] * 1e3:7.1f} ms ({flops / best[name] / 1e9:4.0f} GFLOP/s, "
            f"{ratio[name]:.2f}x oneDNN's time)" for name in paths), flush=True)
    print(json.dumps({"bench": "prefill_matmul", "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
