"""What one core of this CPU can do at most, and how close our bf16 engine comes to it, in one run: the rate
a core streams memory and its peak bf16 multiply-add rate (cpu_bounds.c), then our one-stream decode (bytes
of weights read a second) and a prompt's prefill (matmul FLOPs a second) on the random Qwen3-0.6B checkpoint.

A decode step of one stream reads every weight once, so its tok/s times the weights' bytes can never pass the
streaming rate; a prefill's matmuls can never pass the peak multiply rate. Any engine on this core, vLLM's
included, is held by the same bounds: a ratio against a peer that needs more than the bound allows cannot
be met at the same precision. Run it on one core, nothing else running:
    taskset -c 1 python -m bench.bench_cpu_bounds

--streams N also runs bench_peers' mixed workload in process (N streams at once, prompts 32-512 tokens,
outputs 32-128, greedy) and holds each step against its own bound: the larger of its matmul FLOPs at the
peak rate and its bytes (the weights, and the cached keys and values its decoding rows read) at the
streaming rate. Attention's arithmetic and every other cost are left out, so the bound is below what any
engine can take.
"""
from __future__ import annotations

import argparse
import ctypes
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

from bench.bench_engine import DEFAULT_CHECKPOINT, ensure_checkpoint, run_ours  # noqa: E402
from bench.cpu_kind import cpu_kind  # noqa: E402
from services.model_worker.config.sampling import SamplingParams  # noqa: E402
from services.model_worker.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from services.model_worker.kernels import build  # noqa: E402

SOURCE = pathlib.Path(__file__).with_name("cpu_bounds.c")
PEAK_ITERATIONS = 20_000_000
FLOPS_PER_ITERATION = 12 * 16 * 2 * 2  # cpu_bounds.c: accumulators x lanes x pairs x (multiply, add)


def load() -> ctypes.CDLL:
    library = build.load(SOURCE, "cpu bounds")
    if library is None:
        raise SystemExit("cpu_bounds.c did not build (gcc is needed)")
    library.read_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    library.read_sum.restype = ctypes.c_int64
    library.bf16_dot_peak.argtypes = [ctypes.c_int64]
    library.bf16_dot_peak.restype = ctypes.c_float
    return library


def read_rate(library: ctypes.CDLL, buffer: torch.Tensor) -> float:
    """GB/s of one pass over the buffer."""
    start = time.perf_counter()
    library.read_sum(buffer.data_ptr(), buffer.numel())
    return buffer.numel() / (time.perf_counter() - start) / 1e9


def peak_rate(library: ctypes.CDLL) -> float:
    """GFLOP/s of bf16 multiply-adds in registers."""
    start = time.perf_counter()
    library.bf16_dot_peak(PEAK_ITERATIONS)
    return PEAK_ITERATIONS * FLOPS_PER_ITERATION / (time.perf_counter() - start) / 1e9


def weight_counts(engine: LLMEngine) -> tuple[int, int, int, int]:
    """(bytes of bf16 weights one decode step reads, the decoder layers' matmul weights, the head's weights, the
    last layer's matmul weights after its attention). The head (tied to the embedding here) is read once a step
    and multiplies only the rows that sample; the embedding table is otherwise only indexed. The last layer's
    output projection and MLP multiply only the rows a step reads (served-speed.md, item 43)."""
    layers = engine.model.model.layers
    head = engine.config.vocab_size * engine.config.hidden_size
    layer_params = sum(p.numel() for p in layers.parameters())
    matmul_params = sum(p.numel() for name, p in layers.named_parameters() if "norm" not in name)
    tail = sum(p.numel() for name, p in layers[-1].named_parameters()
               if "norm" not in name and "qkv_proj" not in name)
    return (layer_params + head) * 2, matmul_params, head, tail


def step_flops(counts: tuple[int, int, int, int], rows: int, rows_read: int) -> float:
    """Matmul FLOPs of a step of `rows` rows of which `rows_read` sample (and run the last layer to its end)."""
    _, matmul_params, head, tail = counts
    return 2.0 * (matmul_params * rows - tail * (rows - rows_read) + head * rows_read)


def model_sizes(engine: LLMEngine, prompt_tokens: int) -> tuple[int, float]:
    """(bytes of weights one decode step reads, matmul FLOPs of a prompt of prompt_tokens tokens)."""
    counts = weight_counts(engine)
    return counts[0], step_flops(counts, prompt_tokens, 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefill-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--buffer-gb", type=float, default=1.2, help="the streamed buffer: about the weights' size")
    parser.add_argument("--bounds-only", action="store_true", help="skip the engine")
    parser.add_argument("--streams", type=int, default=0, help="also the mixed workload of this many streams")
    parser.add_argument("--seed", type=int, default=0, help="the mixed workload's prompts and lengths")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    library = load()
    if not library.has_bf16_dot():
        print("no AVX512-BF16 on this CPU: the multiply bound is not measured")
    buffer = torch.ones(int(args.buffer_gb * 1e9), dtype=torch.uint8)
    engine = sizes = None
    if not args.bounds_only:
        ensure_checkpoint(args.checkpoint_dir, "qwen3-0.6b")
        engine = LLMEngine(args.checkpoint_dir, EngineConfig(device="cpu", dtype="bfloat16",
                                                             num_blocks=64 + 48 * args.streams,
                                                             enable_prefix_caching=False))
        sizes = model_sizes(engine, args.prefill_tokens)
    rng = random.Random(0)
    rows = {"read GB/s": [], "peak GFLOP/s": [], "decode GB/s": [], "prefill GFLOP/s": []}
    read_rate(library, buffer)  # first touch of the pages
    for r in range(args.rounds):  # each measure in turn, so the machine's drift falls on all of them
        rows["read GB/s"].append(read_rate(library, buffer))
        if library.has_bf16_dot():
            rows["peak GFLOP/s"].append(peak_rate(library))
        if engine is not None:
            decode = run_ours(engine, [rng.randrange(1000, 100000) for _ in range(16)], args.decode_tokens)
            prefill = run_ours(engine, [rng.randrange(1000, 100000) for _ in range(args.prefill_tokens)], 1)
            rows["decode GB/s"].append(decode.decode_tps * sizes[0] / 1e9)
            rows["prefill GFLOP/s"].append(sizes[1] / prefill.ttft / 1e9)
        print(f"round {r + 1}: " + ", ".join(f"{name} {values[-1]:.1f}" for name, values in rows.items() if values))
    medians = {name: statistics.median(values) for name, values in rows.items() if values}
    best = {name: max(values) for name, values in rows.items() if values}
    print(f"\n{cpu_kind()} CPU, one core:")
    for name in medians:
        print(f"  {name:>16}: median {medians[name]:8.1f}, best {best[name]:8.1f}")
    shares = {}
    if "decode GB/s" in medians:
        shares["decode / read bound"] = medians["decode GB/s"] / best["read GB/s"]
        print(f"  decode reads {sizes[0] / 1e9:.2f} GB a token: {shares['decode / read bound']:.2f} of the best "
              f"streaming rate, so at most {best['read GB/s'] * 1e9 / sizes[0]:.1f} tok/s on this core")
    if "prefill GFLOP/s" in medians and "peak GFLOP/s" in medians:
        shares["prefill / multiply bound"] = medians["prefill GFLOP/s"] / best["peak GFLOP/s"]
        print(f"  a {args.prefill_tokens}-token prompt's matmuls are {sizes[1] / 1e9:.1f} GFLOP: the whole prefill "
              f"runs at {shares['prefill / multiply bound']:.2f} of the peak multiply rate, so it takes at least "
              f"{sizes[1] / best['peak GFLOP/s'] / 1e6:.0f} ms here")
    mixed = None
    if engine is not None and args.streams:
        mixed = mixed_workload(engine, args.streams, random.Random(args.seed), best["read GB/s"] * 1e9,
                               best["peak GFLOP/s"] * 1e9)
        print(f"\n{args.streams} streams in process ({mixed['prompt_tokens']} prompt tokens, {mixed['output_tokens']} "
              f"output tokens): {mixed['seconds']:.2f} s, {mixed['tok_s']:.1f} tok/s; the steps' bounds sum to "
              f"{mixed['bound_seconds']:.2f} s ({mixed['bound_tok_s']:.1f} tok/s at most)")
        for kind in ("prefill", "decode"):
            part = mixed[kind]
            print(f"  {kind:>7} steps: {part['steps']:4d}, {part['seconds']:.2f} s against a bound of "
                  f"{part['bound_seconds']:.2f} s ({part['bound_seconds'] / part['seconds']:.2f} of it)")
    print(json.dumps({"bench": "cpu_bounds", "cpu_kind": cpu_kind(), "rounds": rows, "medians": medians,
                      "best": best, "shares": shares, "mixed": mixed,
                      "decode_bytes": sizes[0] if sizes else None, "prefill_flops": sizes[1] if sizes else None}))


def mixed_workload(engine: LLMEngine, streams: int, rng: random.Random, bytes_per_s: float,
                   flops_per_s: float) -> dict:
    """The workload's wall time and each step's, split into steps with prompt tokens and pure decode steps,
    beside the sum of the steps' bounds."""
    config = engine.config
    counts = weight_counts(engine)
    weight_bytes = counts[0]
    kv_bytes_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 2
    requests = [([rng.randrange(1000, 100000) for _ in range(rng.randint(32, 512))], rng.randint(32, 128))
                for _ in range(streams)]
    for i, (prompt, output) in enumerate(requests):
        engine.add_request(f"mixed-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True))
    batches = []
    schedule = engine.scheduler.schedule

    def recorded():
        batch = schedule()
        if batch:  # contexts before the step: what its decoding rows' attention reads
            batches.append((list(batch.num_tokens), [len(seq) for seq in batch.seqs]))
        return batch

    engine.scheduler.schedule = recorded
    parts = {kind: {"steps": 0, "seconds": 0.0, "bound_seconds": 0.0} for kind in ("prefill", "decode")}
    output_tokens = 0
    start = time.perf_counter()
    try:
        while engine.has_work():
            before, step_start = len(batches), time.perf_counter()
            outputs = engine.step()
            seconds = time.perf_counter() - step_start
            output_tokens += len(outputs)
            if len(batches) == before:
                continue
            tokens, contexts = batches[-1]
            flops = step_flops(counts, sum(tokens), len(outputs))
            read = weight_bytes + sum(c * kv_bytes_per_token for n, c in zip(tokens, contexts) if n == 1)
            part = parts["prefill" if any(n > 1 for n in tokens) else "decode"]
            part["steps"] += 1
            part["seconds"] += seconds
            part["bound_seconds"] += max(flops / flops_per_s, read / bytes_per_s)
    finally:
        engine.scheduler.schedule = schedule
    seconds = time.perf_counter() - start
    bound = sum(part["bound_seconds"] for part in parts.values())
    return {"prompt_tokens": sum(len(p) for p, _ in requests), "output_tokens": output_tokens, "seconds": seconds,
            "tok_s": output_tokens / seconds, "bound_seconds": bound, "bound_tok_s": output_tokens / bound, **parts}


if __name__ == "__main__":
    main()
