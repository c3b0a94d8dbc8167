"""Steps with prompts in them through the fused layer loop (kernels/decoder.c) against the same steps layer by
layer, in one engine on the random Qwen3-0.6B checkpoint, in turns: what the C loop saves a prefill.

The engine's FusedDecode takes prefill and mixed steps where the weights are in VNNI order, or in int8 with int8
activations (--quantization int8), over any cache (--kv-cache-dtype); its `prompts`
switch sends them layer by layer instead, through the same kernels. Per round, each case runs once each way
(the first flipped every round) on the same fresh prompts:
  - prefill N: one fresh prompt of N tokens, one output token (the time to the first token);
  - mixed B+N: B sequences decoding when a fresh N-token prompt joins them; the time of that one step.
Prints each round, the median times, the median of per-round ratios (fused / layers) and whether the tokens
agreed (they must: the loop keeps every bit), then one JSON line. Pin it to one CPU for the engine's
one-CPU placement:
    taskset -c 1 python -m bench.bench_fused_steps --threads 1
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.bench_engine import DEFAULT_CHECKPOINT, ensure_checkpoint, paired_medians, run_ours  # noqa: E402
from services.model_worker.config.sampling import SamplingParams  # noqa: E402
from services.model_worker.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402


def mixed_step(engine: LLMEngine, decoding: list[list[int]], prompt: list[int]) -> tuple[float, list[int]]:
    """Start the decoding sequences, add the prompt once they all decode, and time the step that prefills it;
    returns that time and every token the requests produced."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    stamp = time.monotonic_ns()
    for i, ids in enumerate(decoding):
        engine.add_request(f"dec-{stamp}-{i}", ids, params)
    engine.step()  # their prefill (one step: the budget holds them)
    engine.add_request(f"new-{stamp}", prompt, params)
    start = time.perf_counter()
    outputs = engine.step()
    elapsed = time.perf_counter() - start
    tokens = [o.token_id for o in outputs]
    while engine.has_work():
        tokens += [o.token_id for o in engine.step()]
    return elapsed, tokens


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefill-tokens", default="32,128,512")
    parser.add_argument("--mixed", default="4+128,16+128", help="B+N cases: B decoding sequences, an N-token prompt")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quantization", choices=("none", "int8"), default="none",
                        help="int8: weights and activations in int8 (w8a8_linear.c), which also take every row count")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "int8"), default="auto",
                        help="an 8-bit cache: the loop dequantizes a prompt's keys as the layers gather them")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ensure_checkpoint(args.checkpoint_dir, "qwen3-0.6b")
    engine = LLMEngine(args.checkpoint_dir, EngineConfig(device="cpu", dtype="bfloat16", enable_prefix_caching=False,
                                                         quantization=args.quantization,
                                                         kv_cache_dtype=args.kv_cache_dtype))
    fused = engine.model.model.fused_decode
    if fused is None or not fused.prompts:
        raise SystemExit("the fused loop takes no step with prompts here (it needs bf16 weights in VNNI order, or "
                         "int8 weights with int8 activations on VNNI or AMX-INT8)")
    rng = random.Random(0)

    def fresh(tokens: int) -> list[int]:
        return [rng.randrange(1000, 100000) for _ in range(tokens)]

    cases = [("prefill", int(t)) for t in args.prefill_tokens.split(",") if t]
    cases += [("mixed", tuple(int(v) for v in c.split("+"))) for c in args.mixed.split(",") if c]

    def inputs_for(case) -> list:
        """Fresh tokens for a case: [prompt] for a prefill, [the decoding sequences' prompts, the new prompt]."""
        kind, size = case
        return [fresh(size)] if kind == "prefill" else [[fresh(64) for _ in range(size[0])], fresh(size[1])]

    def run(case, inputs, way: str) -> tuple[float, list[int]]:
        fused.prompts = way == "fused"
        if case[0] == "prefill":
            result = run_ours(engine, inputs[0], 1)
            return result.ttft, result.tokens
        return mixed_step(engine, inputs[0], inputs[1])

    for case in cases:  # warm both ways
        inputs = inputs_for(case)
        for way in ("fused", "layers"):
            run(case, inputs, way)
    ways = ["fused", "layers"]
    times = {case: {way: [] for way in ways} for case in cases}
    agreed = dict.fromkeys(cases, 0)
    for r in range(args.rounds):
        for case in cases:
            kind, size = case
            inputs = inputs_for(case)
            got = {}
            for way in ways if r % 2 == 0 else ways[::-1]:
                elapsed, got[way] = run(case, inputs, way)
                times[case][way].append(elapsed)
            agreed[case] += got["fused"] == got["layers"]
            t = times[case]
            print(f"round {r} {kind} {size}: fused {t['fused'][-1] * 1e3:7.1f} ms  layers {t['layers'][-1] * 1e3:7.1f} ms"
                  f"  fused/layers {t['fused'][-1] / t['layers'][-1]:.3f}", flush=True)
    fused.prompts = True
    results = {}
    for case, runs in times.items():
        ratio, med = paired_medians(runs, "fused", "layers")
        name = f"{case[0]} {case[1]}" if case[0] == "prefill" else f"mixed {case[1][0]}+{case[1][1]}"
        print(f"{name}: fused {med['fused'] * 1e3:7.1f} ms  layers {med['layers'] * 1e3:7.1f} ms  "
              f"fused/layers {ratio:.3f}x  tokens agreed {agreed[case]}/{args.rounds}", flush=True)
        results[name] = {"fused_s": med["fused"], "layers_s": med["layers"], "ratio": ratio, "agreed": agreed[case]}
    engine.close()
    print(json.dumps({"bench": "fused_steps", "threads": args.threads, "rounds": args.rounds, "results": results}))


if __name__ == "__main__":
    main()
