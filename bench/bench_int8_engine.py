"""The engine with int8 weights (and with the head quantized too) against bf16, side by side in one process on
the random Qwen3-0.6B checkpoint: single-stream decode tok/s and a prompt's time to first token.

Per round the engines take turns (the order rotated each round) on a fresh prompt of --prefill-tokens tokens
(one output token: the time to the first token) and on one stream decoding --decode-tokens tokens after a
16-token prompt. Prints each round, then medians and the median of per-round ratios against bf16 (decode:
tok/s over bf16's; TTFT: time over bf16's), then one JSON line. Pin it for a steadier figure:
    taskset -c 0,1 python -m bench.bench_int8_engine --threads 2
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

from bench.bench_engine import DEFAULT_CHECKPOINT, ensure_checkpoint, paired_medians, run_ours  # noqa: E402
from services.model_worker.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402

ENGINES = {"bf16": {}, "int8": dict(quantization="int8"),
           "int8+head": dict(quantization="int8", quantize_lm_head=True)}


def prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(1000, 100000) for _ in range(tokens)]


def measure(engine: LLMEngine, workload: str, rng: random.Random, args) -> float:
    """Seconds to the first token (ttft) or decode tok/s (decode)."""
    if workload == "ttft":
        return run_ours(engine, prompt(rng, args.prefill_tokens), 1).ttft
    return run_ours(engine, prompt(rng, 16), args.decode_tokens).decode_tps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--num-blocks", type=int, default=256, help="KV blocks of 16 tokens per engine (three in memory)")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"of {', '.join(ENGINES)}; the first is the base")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ensure_checkpoint(args.checkpoint_dir, "qwen3-0.6b")
    names = args.engines.split(",")
    engines = {name: LLMEngine(args.checkpoint_dir, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=args.num_blocks,
                                                                 enable_prefix_caching=False, **ENGINES[name]))
               for name in names}
    for name, engine in engines.items():
        body, head = engine.model.model.layers[0].mlp.down_proj, engine.model.lm_head
        print(f"{name}: layers {body.method.name}, head {getattr(getattr(head, 'method', None), 'name', '-')}, "
              f"fused decode {'yes' if engine.model.model.fused_decode else 'no'}", flush=True)
    rng = random.Random(0)
    workloads = ("ttft", "decode")
    for engine in engines.values():
        for workload in workloads:
            measure(engine, workload, rng, args)  # warm: kernels built, caches touched
    times = {w: {name: [] for name in names} for w in workloads}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for workload in workloads:
            for name in order:
                times[workload][name].append(measure(engines[name], workload, rng, args))
            cells = "  ".join(f"{name} {times[workload][name][-1] * (1e3 if workload == 'ttft' else 1):.1f}"
                              for name in names)
            print(f"round {r} {workload:6s}: {cells}", flush=True)
    results = {}
    for workload, runs in times.items():
        unit, scale = ("ms", 1e3) if workload == "ttft" else ("tok/s", 1)
        results[workload] = {}
        for name in names[1:]:
            ratio, med = paired_medians(runs, name, names[0])
            print(f"{workload:6s}: {name} {med[name] * scale:8.1f} {unit}  {names[0]} {med[names[0]] * scale:8.1f} "
                  f"{unit}  {name}/{names[0]} {ratio:.3f}x  (range {min(runs[name]) * scale:.1f}-"
                  f"{max(runs[name]) * scale:.1f})", flush=True)
            results[workload][name] = {"median": med[name], "base": med[names[0]], "ratio": ratio}
    for engine in engines.values():
        engine.close()
    print(json.dumps({"bench": "int8_engine", "threads": args.threads, "rounds": args.rounds,
                      "prefill_tokens": args.prefill_tokens, "results": results}))


if __name__ == "__main__":
    main()
