"""Our engine against itself with one setting changed, in one process: decode speed and tokens, side by side.

--compare picks the variants, each an LLMEngine on the same checkpoint, all built before the first round:
  async: asynchronous scheduling off (each step read back before the next is scheduled) against on;
  fp8:   bf16 weights against fp8 ones (128 x 128 blocks, quantized as they load), the vocab projection left
         in bf16 (--quantization fp8) and quantized too (--quantize-lm-head);
  ngram: plain decode against prompt-lookup speculation (--k proposals) on an input-grounded prompt: a random
         seed prompt followed by the plain engine's own greedy continuation of it, which a random-weight
         model's greedy decode soon turns into a loop, so the next tokens repeat spans of the prompt;
  moe:   one engine on a random slice of Qwen3-30B-A3B's shape (bench/bench_moe.py's checkpoint, --moe-layers
         layers of 128 experts, top 8), nothing to compare: its speed alone.
The dense variants use a random checkpoint with Qwen3-0.6B's exact config (bf16). For each --streams count N,
in rounds (the variants' order rotating every round), every variant generates the same N greedy requests
(--prompt-len random tokens or the grounded prompt, --new-tokens each):
  N = 1: decode tok/s, the tokens after the first over the time from the first to the last;
  N > 1: output tok/s over the whole run, first tokens included.
Ratios against the first variant are medians of per-round ratios; tokens: how many of the N streams
generated exactly the first variant's tokens, and the shortest prefix on which they agree.

    python -m bench.bench_engine_variants --device cuda --compare async --streams 1,64
    python -m bench.bench_engine_variants --compare ngram --quick     # a smoke check on a tiny checkpoint

The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.bench_engine import (Series, agreeing_prefix, cpu_name, ensure_checkpoint, random_prompt,  # noqa: E402
                                run_ours, run_ours_streams)
from services.model_worker.config.engine import EngineConfig, SchedulerLimits, SpeculativeConfig  # noqa: E402
from services.model_worker.engine.llm_engine import LLMEngine  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / ".cache" / "bench-qwen3-0.6b"
# EngineConfig fields of each variant; the first is the base the others are compared with.
VARIANTS = {
    "async": {"off": dict(async_scheduling=False), "on": dict(async_scheduling=True)},
    "fp8": {"bf16": {}, "fp8": dict(quantization="fp8"), "fp8+head": dict(quantization="fp8", quantize_lm_head=True)},
    "ngram": {"plain": {}, "ngram": {}},  # the speculative config takes --k: see variant_configs
    "moe": {"bf16": {}},
}


def variant_configs(args: argparse.Namespace, max_model_len: int) -> dict[str, EngineConfig]:
    streams = max(args.streams)
    if args.device == "cpu":
        memory = dict(kv_cache_bytes=64 << 20)
    else:  # the variants share the GPU
        memory = dict(gpu_memory_utilization=args.gpu_memory_utilization)
    configs = {}
    for name, fields in VARIANTS[args.compare].items():
        if args.compare == "ngram" and name == "ngram":
            fields = dict(speculative=SpeculativeConfig("ngram", num_speculative_tokens=args.k))
        configs[name] = EngineConfig(
            device=args.device, dtype="bfloat16", max_model_len=max_model_len, **memory, **fields,
            limits=SchedulerLimits(max_num_seqs=max(64, streams), max_num_batched_tokens=max(2048, streams)))
    return configs


def moe_checkpoint(args: argparse.Namespace, tmp: str) -> pathlib.Path:
    from bench.bench_moe import ensure_checkpoint as ensure_moe

    if args.quick:
        return ensure_moe(pathlib.Path(tmp) / "moe", argparse.Namespace(layers=1, experts=8, top_k=2, hidden=128,
                                                                        expert_size=64))
    shape = argparse.Namespace(layers=args.moe_layers, experts=128, top_k=8, hidden=2048, expert_size=768)
    return ensure_moe(args.moe_checkpoint or ROOT / ".cache" / f"moe-30b-a3b-slice-{shape.layers}l-128e", shape)


def speculation_counts(engine: LLMEngine) -> tuple[int, int, int]:
    s = engine.speculator
    return (s.num_proposed, s.num_accepted, s.num_verify_steps) if s is not None else (0, 0, 0)


def run(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """One stream: decode tok/s; several: output tok/s over the run. With each stream's tokens."""
    if len(prompts) == 1:
        one = run_ours(engine, prompts[0], new_tokens)
        return one.decode_tps, [one.tokens]
    many = run_ours_streams(engine, prompts, new_tokens)
    return many.output_tps, many.tokens


def bench(checkpoint: pathlib.Path, args: argparse.Namespace) -> dict:
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    generator = torch.Generator().manual_seed(1234)
    grounded = args.compare == "ngram"
    prompt_len = args.seed_len + args.grounding if grounded else args.prompt_len
    configs = variant_configs(args, prompt_len + args.new_tokens + args.k + 1)
    loads, engines = {}, {}
    for name, config in configs.items():
        start = time.perf_counter()
        engines[name] = LLMEngine(checkpoint, config)
        loads[name] = time.perf_counter() - start
    names = list(engines)
    base = engines[names[0]]
    prompt = None
    if grounded:  # the seed and the plain engine's own continuation of it
        seed = random_prompt(args.seed_len, vocab, generator)
        prompt = seed + run_ours(base, seed, args.grounding).tokens
    warm = random_prompt(prompt_len, vocab, generator)
    for engine in engines.values():  # first calls pay one-time costs (kernel builds, first-touch of buffers)
        for n in args.streams:
            run(engine, [warm] * n, 4)
    counted_before = {name: speculation_counts(e) for name, e in engines.items()}
    results = {}
    for n in args.streams:
        tps = {name: Series() for name in names}
        ratios = {name: [] for name in names[1:]}
        identical = {name: [] for name in names[1:]}
        shortest = {name: args.new_tokens for name in names[1:]}
        for r in range(args.rounds):
            prompts = [prompt] * n if grounded else [random_prompt(prompt_len, vocab, generator) for _ in range(n)]
            order = names[r % len(names):] + names[:r % len(names)]
            got = {name: run(engines[name], prompts, args.new_tokens) for name in order}
            for name in names:
                tps[name].add(got[name][0])
            for name in names[1:]:
                ratios[name].append(got[name][0] / got[names[0]][0])
                pairs = list(zip(got[name][1], got[names[0]][1]))
                identical[name].append(sum(a == b for a, b in pairs))
                shortest[name] = min([shortest[name]] + [agreeing_prefix(a, b) for a, b in pairs])
            print(f"  {n} stream(s), round {r + 1}/{args.rounds}: "
                  + ", ".join(f"{name} {got[name][0]:.0f}" for name in names)
                  + (" decode tok/s" if n == 1 else " output tok/s"), file=sys.stderr, flush=True)
        results[str(n)] = {
            "unit": "decode tok/s" if n == 1 else "output tok/s",
            "tps": {name: s.summary() for name, s in tps.items()},
            "ratio_vs_first": {name: statistics.median(v) for name, v in ratios.items()},
            "ratio_per_round": ratios,
            "identical_streams_per_round": identical,
            "shortest_agreeing_prefix": shortest,
        }
    speculation = {}
    for name, engine in engines.items():
        if engine.speculator is None:
            continue
        proposed, accepted, verifications = (now - then for now, then in zip(speculation_counts(engine),
                                                                             counted_before[name]))
        decoded = args.rounds * sum(n * (args.new_tokens - 1) for n in args.streams)
        passes = verifications + (decoded - accepted - verifications)  # the others were plain decode steps
        speculation[name] = {"acceptance_rate": accepted / max(proposed, 1),
                             "tokens_per_pass": decoded / max(passes, 1), "proposed": proposed, "accepted": accepted}
    for engine in engines.values():
        engine.close()
    return {"variants": names, "load_s": loads, "prompt_len": prompt_len, "results": results,
            "speculation": speculation}


def print_table(report: dict) -> None:
    names = report["variants"]
    for n, res in report["results"].items():
        first = names[0]
        print(f"\n{n} stream(s), {res['unit']}, median (min-max):")
        for name in names:
            t = res["tps"][name]
            line = f"  {name:10s}{t['median']:10.1f} ({t['min']:.1f}-{t['max']:.1f})"
            if name != first:
                line += (f"  x{res['ratio_vs_first'][name]:.3f} vs {first}; streams with {first}'s exact tokens per "
                         f"round {res['identical_streams_per_round'][name]} of {n}, shortest agreeing prefix "
                         f"{res['shortest_agreeing_prefix'][name]}")
            print(line)
    for name, s in report["speculation"].items():
        print(f"  {name}: acceptance {s['acceptance_rate']:.2f}, {s['tokens_per_pass']:.2f} tokens a target pass")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", required=True, choices=sorted(VARIANTS))
    p.add_argument("--checkpoint-dir", type=pathlib.Path, default=DEFAULT_CHECKPOINT,
                   help="the dense checkpoint, written on first use")
    p.add_argument("--moe-checkpoint", type=pathlib.Path, default=None,
                   help="--compare moe: where its checkpoint is cached (default .cache/moe-30b-a3b-slice-...)")
    p.add_argument("--moe-layers", type=int, default=2, help="--compare moe: decoder layers of the slice")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--streams", default="1", help="comma-separated stream counts, e.g. 1,64")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seed-len", type=int, default=32, help="--compare ngram: random tokens before the grounding")
    p.add_argument("--grounding", type=int, default=96,
                   help="--compare ngram: tokens of the plain engine's own continuation in the prompt")
    p.add_argument("--k", type=int, default=4, help="--compare ngram: --num-speculative-tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.25, help="each variant's share of the GPU")
    p.add_argument("--require-identical", action="store_true",
                   help="exit 1 if any variant's tokens differ from the first's (after the report)")
    p.add_argument("--quick", action="store_true", help="a tiny checkpoint and short runs: checks the script works")
    args = p.parse_args(argv)
    args.streams = sorted({int(n) for n in args.streams.split(",") if n.strip()})
    if not args.streams or args.streams[0] < 1:
        p.error("--streams takes counts of at least 1")
    if args.quick:
        args.rounds, args.prompt_len, args.new_tokens, args.seed_len, args.grounding = 1, 16, 8, 8, 24
        args.streams = [min(n, 4) for n in args.streams]
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    started, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        if args.compare == "moe":
            checkpoint = moe_checkpoint(args, tmp)
            described = "random, tiny MoE (--quick)" if args.quick else "random, a slice of Qwen3-30B-A3B's shape"
        elif args.quick:
            checkpoint, described = ensure_checkpoint(pathlib.Path(tmp) / "tiny", "tiny"), "random, tiny (--quick)"
        else:
            checkpoint, described = ensure_checkpoint(args.checkpoint_dir, "qwen3-0.6b"), "random, Qwen3-0.6B config"
        report = {"benchmark": "bench_engine_variants", "compare": args.compare, "checkpoint": described,
                  **bench(checkpoint, args)}
    print_table(report)
    report["machine"] = {"cpu": cpu_name(), "cpus": os.cpu_count(), "torch": torch.__version__,
                         "gpu": torch.cuda.get_device_name(args.device) if args.device != "cpu" else None,
                         "load_average_before": load_before, "load_average_after": os.getloadavg()}
    report["settings"] = {k: getattr(args, k) for k in ("device", "streams", "rounds", "new_tokens", "k")}
    report["settings"]["prompt_len"] = report.pop("prompt_len")
    report["wall_s"] = time.perf_counter() - started
    print(json.dumps(report))
    differing = [f"{name} at {n} stream(s)" for n, res in report["results"].items()
                 for name, same in res["identical_streams_per_round"].items() if any(k < int(n) for k in same)]
    if args.require_identical and differing:
        sys.exit(f"tokens differ from {report['variants'][0]}'s: {', '.join(differing)}")
    return report


if __name__ == "__main__":
    main()
