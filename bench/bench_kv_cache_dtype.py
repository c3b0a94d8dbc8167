"""The 8-bit KV caches (--kv-cache-dtype fp8, int8) against the bf16 cache, side by side in one process on the
random Qwen3-0.6B checkpoint: decode tok/s of --streams streams at a --context-token context, and the mean KL
divergence of the 8-bit caches' next-token distributions from the bf16 cache's.

Each engine (bf16 weights, one per cache kind) holds --streams sequences of --context tokens, their cache rows
written through the engine's own cache write from random keys and values (a decode step's cost does not depend
on what the rows hold, and 16 prompts of 1,024 tokens would take minutes to prefill per engine on 2 CPUs); then
in every round the engines take turns (the order rotated each round) running --steps decode steps of all their
streams through the model runner (the fused decode loop where it applies) and a greedy argmax. Prints each round,
the medians and the median of per-round ratios against the bf16 cache, then the KL: --kl-prompts prompts of
--kl-context tokens prefilled and --kl-steps tokens decoded (the bf16 cache's greedy tokens, teacher-forced into
all engines), KL(bf16 cache || 8-bit cache) averaged over those positions.
Last, one JSON line. At 1,024 tokens a decode step of 16 streams reads 1.9 GB of bf16 cache (0.94 GB in 8 bits)
beside 1.2 GB of weights. Pin it for a steadier figure:
    taskset -c 0,1 python -m bench.bench_kv_cache_dtype --threads 2
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

from bench.bench_engine import DEFAULT_CHECKPOINT, ensure_checkpoint, paired_medians  # noqa: E402
from bench.cpu_kind import cpu_kind, cpu_model  # noqa: E402
from services.model_worker.config.engine import SchedulerLimits  # noqa: E402
from services.model_worker.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from services.model_worker.executor.step_inputs import StepInputs  # noqa: E402

KINDS = ("auto", "fp8", "int8")
BLOCK_SIZE = 16


def prompt(rng: random.Random, tokens: int) -> list[int]:
    return [rng.randrange(1000, 100000) for _ in range(tokens)]


def make_engine(checkpoint: pathlib.Path, kind: str, args) -> LLMEngine:
    longest = max(args.context + args.steps * (args.rounds + 2), args.kl_context + args.kl_steps) + 1
    per_seq = -(-longest // BLOCK_SIZE)
    return LLMEngine(checkpoint, EngineConfig(
        device="cpu", dtype="bfloat16", kv_cache_dtype=kind, enable_prefix_caching=False, block_size=BLOCK_SIZE,
        num_blocks=max(args.streams, args.kl_prompts) * per_seq + 1,
        limits=SchedulerLimits(max_num_seqs=max(args.streams, args.kl_prompts),
                               max_num_batched_tokens=max(768, args.streams))))


class Streams:
    """--streams sequences of --context tokens in one engine's cache, each in its own run of blocks."""

    def __init__(self, engine: LLMEngine, streams: int, context: int, room: int, seed: int):
        per_seq = -(-(context + room) // BLOCK_SIZE)
        self.engine, self.lengths = engine, [context] * streams
        self.tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(streams)]
        gen = torch.Generator().manual_seed(seed)
        slots = torch.tensor([b * BLOCK_SIZE + j for t in self.tables for b in t[:-(-context // BLOCK_SIZE)]
                              for j in range(BLOCK_SIZE)])
        backend = engine.runner.attention
        with torch.inference_mode():
            for layer in engine.kv_cache.layers:
                kv_heads, _, head_dim = layer[0].shape
                k, v = (torch.randn(slots.shape[0], kv_heads, head_dim, generator=gen).bfloat16() for _ in range(2))
                backend.write_kv(k, v, layer[0], layer[1], slots, **layer.scales)
        self.tokens = torch.randint(1000, 100000, (streams,), generator=gen).tolist()

    def decode_tps(self, steps: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            for _ in range(steps):
                self.lengths = [n + 1 for n in self.lengths]
                host = StepInputs.build([[t] for t in self.tokens], self.tables, self.lengths, BLOCK_SIZE)
                self.tokens = self.engine.runner.run(host).argmax(-1).tolist()
        return steps * len(self.lengths) / (time.perf_counter() - start)


def next_token_logits(engine: LLMEngine, prompts: list[list[int]], forced: list[list[int]] | None,
                      steps: int) -> tuple[torch.Tensor, list[list[int]]]:
    """(positions, vocab) float32 log-probabilities after each prompt and each of `steps` decoded tokens, every
    sequence in one step; forced: the tokens to feed (None: this engine's greedy ones, returned)."""
    counts = [-(-(len(p) + steps) // BLOCK_SIZE) for p in prompts]
    tables = [list(range(sum(counts[:i]), sum(counts[:i + 1]))) for i in range(len(prompts))]
    lengths = [len(p) for p in prompts]
    rows, fed = [], [[] for _ in prompts]
    with torch.inference_mode():
        logits = engine.runner.run(StepInputs.build(prompts, tables, lengths, BLOCK_SIZE))
        for step in range(steps + 1):
            rows.append(logits.float().log_softmax(-1))
            if step == steps:
                break
            tokens = [f[step] for f in forced] if forced else logits.argmax(-1).tolist()
            for f, t in zip(fed, tokens):
                f.append(t)
            lengths = [n + 1 for n in lengths]
            logits = engine.runner.run(StepInputs.build([[t] for t in tokens], tables, lengths, BLOCK_SIZE))
    return torch.cat(rows), fed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8, help="decode steps an engine runs in a round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kl-prompts", type=int, default=4)
    parser.add_argument("--kl-context", type=int, default=1024)
    parser.add_argument("--kl-steps", type=int, default=16)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"of {', '.join(KINDS)}; the first is the base")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ensure_checkpoint(args.checkpoint_dir, "qwen3-0.6b")
    kinds = args.kinds.split(",")
    print(f"CPU: {cpu_model()} ({cpu_kind()}), {args.threads} threads", flush=True)
    engines = {kind: make_engine(args.checkpoint_dir, kind, args) for kind in kinds}
    rng = random.Random(0)
    streams = {}
    for kind, engine in engines.items():
        streams[kind] = Streams(engine, args.streams, args.context, args.steps * (args.rounds + 2), seed=1)
        streams[kind].decode_tps(args.steps)  # warm: kernels built, caches touched
        print(f"{kind}: cache {str(engine.kv_cache.dtype).removeprefix('torch.')}, fused decode "
              f"{'yes' if engine.model.model.fused_decode else 'no'}", flush=True)
    runs = {kind: [] for kind in kinds}
    for r in range(args.rounds):
        order = kinds[r % len(kinds):] + kinds[:r % len(kinds)]
        for kind in order:
            runs[kind].append(streams[kind].decode_tps(args.steps))
        print(f"round {r}: " + "  ".join(f"{kind} {runs[kind][-1]:.1f} tok/s" for kind in kinds), flush=True)
    results = {}
    for kind in kinds:
        entry = {"median_tps": statistics.median(runs[kind]), "min": min(runs[kind]), "max": max(runs[kind])}
        if kind != kinds[0]:
            entry["ratio"], _ = paired_medians(runs, kind, kinds[0])
        results[kind] = entry
        ratio = f"  {kind}/{kinds[0]} {entry['ratio']:.3f}x" if "ratio" in entry else ""
        print(f"decode {kind:5s}: {entry['median_tps']:7.1f} tok/s (range {entry['min']:.1f}-{entry['max']:.1f})"
              f"{ratio}", flush=True)
    kl_prompts = [prompt(rng, args.kl_context) for _ in range(args.kl_prompts)]
    want, forced = next_token_logits(engines[kinds[0]], kl_prompts, None, args.kl_steps)
    for kind in kinds[1:]:
        got, _ = next_token_logits(engines[kind], kl_prompts, forced, args.kl_steps)
        results[kind]["mean_kl"] = (want.exp() * (want - got)).sum(-1).mean().item()
        print(f"KL({kinds[0]} || {kind}) over {want.shape[0]} positions: {results[kind]['mean_kl']:.5f}", flush=True)
    entropy = -(want.exp() * want).sum(-1).mean().item()
    print(f"mean entropy of the {kinds[0]} cache's distributions: {entropy:.2f} nats", flush=True)
    for engine in engines.values():
        engine.close()
    print(json.dumps({"bench": "kv_cache_dtype", "cpu": cpu_model(), "cpu_kind": cpu_kind(), "threads": args.threads,
                      "streams": args.streams, "context": args.context, "steps": args.steps, "rounds": args.rounds,
                      "kl_prompts": args.kl_prompts, "kl_context": args.kl_context, "entropy": entropy,
                      "results": results}))


if __name__ == "__main__":
    main()
