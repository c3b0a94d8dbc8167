"""The engine on weights reordered into AMX's VNNI order (the default on AMX) against the same engine on
the checkpoint's plain layout, side by side in one process on the random Qwen3-0.6B checkpoint.

Per round, the two engines take turns (the first flipped each round) on:
- a prefill of each prompt length (fresh token ids, one output token): time to the first token;
- one stream decoding (a 16-token prompt, --decode-tokens tokens): decode tok/s;
- a batch of 16 streams (prompts of 32-512 tokens, 32 tokens each): total time, as a burst's steps mix
  prefill chunks and 16-row decodes.
Prints medians and the median of per-round ratios (vnni / plain), then one JSON line. Pin it to one CPU
for the engine's one-CPU placement:
    taskset -c 1 python -m bench.bench_vnni_weights --threads 1
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.bench_engine import (DEFAULT_CHECKPOINT, ensure_checkpoint, paired_medians, run_ours,  # noqa: E402
                                run_ours_streams)
from services.model_worker.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from services.model_worker.model.layers.linear import VnniLinearMethod  # noqa: E402


def prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(1000, 100000) for _ in range(tokens)]


def measure(engine: LLMEngine, workload: str, rng: random.Random, args) -> float:
    """One run of a workload: seconds to the first token (prefill), tok/s (decode) or seconds (batch)."""
    if workload.startswith("prefill"):
        return run_ours(engine, prompt(rng, int(workload.split()[1])), 1).ttft
    if workload == "decode":
        return run_ours(engine, prompt(rng, 16), args.decode_tokens).decode_tps
    prompts = [prompt(rng, rng.randrange(32, 513)) for _ in range(16)]
    return run_ours_streams(engine, prompts, 32).wall_s


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefill-tokens", default="32,128,512")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-decode", action="store_true", help="skip the single-stream decode")
    parser.add_argument("--no-batch", action="store_true", help="skip the 16-stream batch")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ensure_checkpoint(args.checkpoint_dir, "qwen3-0.6b")
    engines = {name: LLMEngine(args.checkpoint_dir, EngineConfig(device="cpu", dtype="bfloat16",
                                                                 enable_prefix_caching=False, vnni_weights=flag))
               for name, flag in (("vnni", True), ("plain", False))}
    assert isinstance(engines["vnni"].model.model.layers[0].mlp.down_proj.method, VnniLinearMethod)
    workloads = [f"prefill {t}" for t in args.prefill_tokens.split(",") if t] + ([] if args.no_decode else ["decode"])
    workloads += [] if args.no_batch else ["batch16"]
    rng = random.Random(0)
    for engine in engines.values():
        for workload in workloads:
            if workload != "batch16":
                measure(engine, workload, rng, args)  # warm both: kernels built, caches touched
    times = {w: {name: [] for name in engines} for w in workloads}
    names = list(engines)
    for r in range(args.rounds):
        for workload in workloads:
            for name in names if r % 2 == 0 else names[::-1]:
                times[workload][name].append(measure(engines[name], workload, rng, args))
            runs = times[workload]
            print(f"round {r} {workload:12s}: vnni {runs['vnni'][-1]:.3f}  plain {runs['plain'][-1]:.3f}  "
                  f"vnni/plain {runs['vnni'][-1] / runs['plain'][-1]:.3f}", flush=True)
    results = {}
    for workload, runs in times.items():
        ratio, med = paired_medians(runs, "vnni", "plain")
        unit = "tok/s" if workload == "decode" else "ms"
        scale = 1 if workload == "decode" else 1e3
        print(f"{workload:12s}: vnni {med['vnni'] * scale:8.1f} {unit}  plain {med['plain'] * scale:8.1f} {unit}  "
              f"vnni/plain {ratio:.3f}x", flush=True)
        results[workload] = {"vnni": med["vnni"], "plain": med["plain"], "ratio": ratio}
    for engine in engines.values():
        engine.close()
    print(json.dumps({"bench": "vnni_weights", "threads": args.threads, "rounds": args.rounds, "results": results}))


if __name__ == "__main__":
    main()
