"""The 8-bit KV caches (--kv-cache-dtype fp8, int8) against the bf16 cache, side by side in one process on the
random Qwen3-0.6B checkpoint: decode tok/s of --streams streams at a --context-token context, and the mean KL
divergence of the 8-bit caches' next-token distributions from the bf16 cache's.

Each engine (bf16 weights, or --quantization's; one per cache kind) holds --streams sequences of --context
tokens, their cache rows written through the engine's own cache write from random keys and values (a decode
step's cost does not depend on what the rows hold, and 16 prompts of 1,024 tokens would take minutes to
prefill per engine on 2 CPUs); then in every round the engines take turns (the order rotated each round)
running --steps decode steps of all their streams through the model runner (the fused decode loop where it
applies) and a greedy argmax. Prints each round, the medians and the median of per-round ratios against the
bf16 cache, then the KL: --kl-prompts prompts of --kl-context tokens prefilled and --kl-steps tokens decoded
(the bf16 cache's greedy tokens, teacher-forced into all engines), KL(bf16 cache || 8-bit cache) averaged over
those positions. Last, one JSON line. At 1,024 tokens a decode step of 16 streams reads 1.9 GB of bf16 cache
(0.94 GB in 8 bits) beside 1.2 GB of weights. Pin it for a steadier figure:
    taskset -c 0,1 python -m bench.bench_kv_cache_dtype --threads 2

With --kernel, the decode-attention kernel alone instead: one layer's call (--streams sequences of --context
tokens, 16 query heads over 8 KV heads of 128, bf16 query, each sequence's blocks one run of ids), each cache
kind's rows in --kernel-layers layers (taken in turn, so the cache is read from memory, not the L3), the kinds
taking turns each round; the median ms per call and the median of per-round ratios against the first kind.
--rev also times another commit's kernel (bench_decode_attention's sources_at) on the same inputs.
    taskset -c 0 python -m bench.bench_kv_cache_dtype --kernel --threads 1
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
        device="cpu", dtype="bfloat16", kv_cache_dtype=kind, quantization=args.quantization,
        enable_prefix_caching=False, block_size=BLOCK_SIZE,
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


def kernel_inputs(kind: str, streams: int, context: int, layers: int, seed: int) -> tuple[dict, list]:
    """The shared step tensors and, per layer, a cache of `kind` ((k, v, k_scale, v_scale)) filled with random
    rows through the kernel's own cache write."""
    from services.model_worker.kernels import cpu_attention
    from services.model_worker.model.layers.attention import kv_quant
    kv_heads, heads, head_dim = 8, 16, 128
    per_seq = -(-context // BLOCK_SIZE) + 1
    slots = streams * per_seq * BLOCK_SIZE
    gen = torch.Generator().manual_seed(seed)
    tables = torch.arange(streams * per_seq, dtype=torch.int32).view(streams, per_seq)
    pos = torch.arange(context)
    step = {"q": torch.randn(streams, heads, head_dim, generator=gen).bfloat16(),
            "context_lens": torch.full((streams,), context, dtype=torch.int32), "block_tables": tables,
            "block_size": BLOCK_SIZE, "scale": head_dim ** -0.5}
    dtype = kv_quant.cache_dtype(kind, torch.bfloat16)
    library = cpu_attention.load()
    caches = []
    for _ in range(layers):
        k_cache = torch.zeros(kv_heads, slots, head_dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        scale_shape = (kv_heads, slots) if dtype == torch.int8 else (1,)
        k_scale, v_scale = torch.ones(scale_shape), torch.ones(scale_shape)
        for b in range(streams):
            slot_mapping = (tables[b].long()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).contiguous()
            k = torch.randn(context, kv_heads, head_dim, generator=gen).bfloat16()
            v = torch.randn(context, kv_heads, head_dim, generator=gen).bfloat16()
            cpu_attention.write_kv(library, k, v, k_cache, v_cache, slot_mapping,
                                   *((k_scale, v_scale) if kind != "auto" else ()))
        caches.append((k_cache, v_cache) + ((k_scale, v_scale) if kind != "auto" else ()))
    return step, caches


def kernel_main(args) -> None:
    """--kernel: the decode-attention kernel alone, each cache kind (and --rev's kernel) in turns."""
    import tempfile

    from bench.bench_decode_attention import sources_at
    from services.model_worker.kernels import cpu_attention
    kinds = args.kinds.split(",")
    print(f"CPU: {cpu_model()} ({cpu_kind()}), {args.threads} threads; {args.streams} x {args.context} tokens, "
          f"16 heads over 8 KV heads of 128", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        libraries = {"": cpu_attention.load()}
        if args.rev:
            libraries[f"@{args.rev}"] = cpu_attention.load(sources_at(args.rev, pathlib.Path(tmp)))
        inputs = {kind: kernel_inputs(kind, args.streams, args.context, args.kernel_layers, seed=1) for kind in kinds}
        names = [kind + lib for kind in kinds for lib in libraries if not (lib and kind == "auto")]

        def call(name: str, layer: int) -> torch.Tensor:
            kind, _, rev = name.partition("@")
            step, caches = inputs[kind]
            k_cache, v_cache, *scales = caches[layer % len(caches)]
            return cpu_attention.paged_decode_attention(libraries[f"@{rev}" if rev else ""], step["q"], k_cache,
                                                        v_cache, step["context_lens"], step["block_tables"],
                                                        step["block_size"], step["scale"], *scales)

        for name in names:
            call(name, 0)  # built and touched
        for name in names:
            if "@" in name:
                diff = (call(name, 0).float() - call(name.partition("@")[0], 0).float()).abs().max().item()
                print(f"{name} against this tree: max difference {diff:.3g}", flush=True)
        runs = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times = []
                for i in range(args.steps):
                    start = time.perf_counter()
                    call(name, i)
                    times.append(time.perf_counter() - start)
                runs[name].append(statistics.median(times) * 1e3)
    results = {}
    for name in names:
        entry = {"median_ms": statistics.median(runs[name]), "min": min(runs[name]), "max": max(runs[name])}
        if name != names[0]:
            entry["ratio"] = statistics.median(t / b for t, b in zip(runs[name], runs[names[0]]))
        results[name] = entry
        ratio = f"  {name}/{names[0]} {entry['ratio']:.3f}x" if "ratio" in entry else ""
        print(f"kernel {name:12s}: {entry['median_ms']:6.3f} ms (range {entry['min']:.3f}-{entry['max']:.3f})"
              f"{ratio}", flush=True)
    print(json.dumps({"bench": "kv_cache_dtype_kernel", "cpu": cpu_model(), "cpu_kind": cpu_kind(),
                      "threads": args.threads, "streams": args.streams, "context": args.context,
                      "rounds": args.rounds, "calls": args.steps, "rev": args.rev, "results": results}))


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
    parser.add_argument("--quantization", choices=("none", "int8", "fp8"), default="none",
                        help="every engine's weights (the caches' comparison at another step cost)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"of {', '.join(KINDS)}; the first is the base")
    parser.add_argument("--kernel", action="store_true", help="time the decode-attention kernel alone "
                        "(--steps calls a round)")
    parser.add_argument("--kernel-layers", type=int, default=4, help="--kernel: layers of cache taken in turn")
    parser.add_argument("--rev", default="", help="--kernel: also time this commit's kernel")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.kernel:
        kernel_main(args)
        return
    ensure_checkpoint(args.checkpoint_dir, "qwen3-0.6b")
    kinds = args.kinds.split(",")
    print(f"CPU: {cpu_model()} ({cpu_kind()}), {args.threads} threads, weights {args.quantization}", flush=True)
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
                      "quantization": args.quantization, "streams": args.streams, "context": args.context,
                      "steps": args.steps, "rounds": args.rounds,
                      "kl_prompts": args.kl_prompts, "kl_context": args.kl_context, "entropy": entropy,
                      "results": results}))


if __name__ == "__main__":
    main()
