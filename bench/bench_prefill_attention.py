"""Prefill attention on the CPU: our kernel (kernels/prefill_attention.c: AMX tiles, or AVX512-BF16 without
AMX) against SDPA, side by side.

1. One layer's attention at Qwen3-0.6B's shape (16 query heads over 8 KV heads of 128, bf16, a fresh
   causal prompt), per prompt length, the two taking turns call by call.
2. A whole prefill through the engine on the random checkpoint with that config: the same prompt
   length, fresh token ids each time, with the CPU backend's prefill kernel on and off in turns.
Prints medians and the median of per-round ratios (kernel / SDPA), then one JSON line. Pin it to one
CPU for the engine's one-CPU placement:
    taskset -c 1 python -m bench.bench_prefill_attention --threads 1
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.bench_engine import DEFAULT_CHECKPOINT, ensure_checkpoint  # noqa: E402
from services.model_worker.config.sampling import SamplingParams  # noqa: E402
from services.model_worker.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from services.model_worker.kernels import cpu_prefill_attention  # noqa: E402


def interleaved(paths: dict, rounds: int) -> dict:
    """Each path's times (s), the paths taking turns every round, the first flipped each round."""
    times = {name: [] for name in paths}
    names = list(paths)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            paths[name]()
            times[name].append(time.perf_counter() - start)
    return times


def report(label: str, times: dict) -> dict:
    ratio = statistics.median(a / b for a, b in zip(times["kernel"], times["sdpa"]))
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(f"{label}: kernel {med['kernel']:8.2f} ms  sdpa {med['sdpa']:8.2f} ms  kernel/sdpa {ratio:.2f}x",
          flush=True)
    return {"kernel_ms": med["kernel"], "sdpa_ms": med["sdpa"], "ratio": ratio}


def layer(library, tokens: int, rounds: int) -> dict:
    heads, kv_heads, dim = 16, 8, 128
    fused = torch.randn(tokens, heads + 2 * kv_heads, dim).bfloat16()  # views of one projection, as in the model
    q, k, v = fused[:, :heads], fused[:, heads:heads + kv_heads], fused[:, heads + kv_heads:]
    out = torch.empty_like(q)
    views = [t.transpose(0, 1)[None] for t in (q, k, v)]
    paths = {"kernel": lambda: cpu_prefill_attention.prefill_attention(library, q, k, v, dim ** -0.5, out),
             "sdpa": lambda: F.scaled_dot_product_attention(*views, is_causal=True, enable_gqa=True)}
    for path in paths.values():
        path()
    return report(f"one layer, {tokens:4d} tokens", interleaved(paths, rounds))


def prefill(engine: LLMEngine, library, tokens: int, rounds: int, rng: random.Random) -> dict:
    backend = engine.runner.attention
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def run(kernel):
        def go():
            backend.prefill_library = kernel
            engine.generate([[rng.randrange(1000, 100000) for _ in range(tokens)]], params)
        return go
    paths = {"kernel": run(library), "sdpa": run(None)}
    for path in paths.values():
        path()
    try:
        return report(f"engine prefill, {tokens:4d} tokens", interleaved(paths, rounds))
    finally:
        backend.prefill_library = library


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", default="32,128,256,512,768")
    parser.add_argument("--engine-tokens", default="128,512")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--engine-rounds", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    library = cpu_prefill_attention.load()
    if library is None:
        raise SystemExit("the prefill kernel does not run here (needs AVX512-BF16 and a C compiler)")
    results = {"layer": {}, "engine": {}}
    for tokens in (int(t) for t in args.tokens.split(",") if t):
        results["layer"][tokens] = layer(library, tokens, args.rounds)
    if args.engine_tokens:
        ensure_checkpoint(args.checkpoint_dir, "qwen3-0.6b")
        engine = LLMEngine(args.checkpoint_dir, EngineConfig(device="cpu", dtype="bfloat16",
                                                             enable_prefix_caching=False))
        assert getattr(engine.runner.attention, "prefill_library", None) is not None, "the CPU backend is not in use"
        rng = random.Random(0)
        for tokens in (int(t) for t in args.engine_tokens.split(",")):
            results["engine"][tokens] = prefill(engine, library, tokens, args.engine_rounds, rng)
        engine.close()
    print(json.dumps({"bench": "prefill_attention", "threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
