"""Decode-step benchmark: attention backends side by side on the engine, at 1, 16 and 64 sequences.

On the random checkpoint with Qwen3-0.6B's exact config (bf16), one engine per batch size is
filled with that many sequences (prompts uniform in 64-256 tokens, as in bench_serving) and
prefilled; then decode steps run with each attention backend in turn, interleaved (A, B, C, A,
B, C, ...), on the same state, and within a backend the batch sizes' engines take turns step by
step (the order flipped every step), so that a ratio between batch sizes compares the same moments. Backends:
  - loop: one SDPA call per sequence per layer, as the engine did before batched attention
    (keys read in place when a sequence's blocks form one run of ids, gathered otherwise);
  - torch: the plain-PyTorch batched path (keys gathered into a padded batch, one SDPA call);
  - cpu-paged: the C kernel reading keys through the block tables (the engine's default on CPU).
Then one sequence at a 64- and a 2048-token context, with the default backend.
Medians with min-max; a ratio is the median of the per-round ratios (each round's figures are
taken step by step side by side). The last line is one JSON object.

    python -m bench.bench_attention            # about 5 minutes on 2 cores
    python -m bench.bench_attention --quick    # a smoke check on a tiny checkpoint
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.bench_engine import DEFAULT_CHECKPOINT, cpu_name, ensure_checkpoint  # noqa: E402
from services.model_worker.config.sampling import SamplingParams  # noqa: E402
from services.model_worker.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from services.model_worker.engine.scheduler import SchedulerLimits  # noqa: E402
from services.model_worker.model.layers.attention.device_backend import default_backend  # noqa: E402
from services.model_worker.model.layers.attention.sdpa import TorchAttention  # noqa: E402

TARGETS = {"step_16_vs_1": 1.5}


class LoopAttention(TorchAttention):
    """The per-sequence loop the engine had before: one SDPA call per sequence and layer.

    Its plans (slice or slot list per sequence) are made once per step, as the old metadata did.
    """

    name = "loop"

    def __init__(self):
        self._plans_for: tuple | None = None
        self._plans: list = []

    def _plan(self, context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> list:
        key = (block_tables.data_ptr(), tuple(block_tables.shape), context_lens.data_ptr())
        if key != self._plans_for:
            self._plans = []
            for table, n in zip(block_tables.tolist(), context_lens.tolist()):
                table = table[:-(-n // block_size)]
                if table == list(range(table[0], table[0] + len(table))):
                    self._plans.append(slice(table[0] * block_size, table[0] * block_size + n))
                else:
                    pos = torch.arange(n)
                    self._plans.append(torch.tensor(table)[pos // block_size] * block_size + pos % block_size)
            self._plans_for = key
        return self._plans

    def decode(self, q, k_cache, v_cache, context_lens, block_tables, block_size, scale):
        num_kv_heads, head_dim = k_cache.shape[0], k_cache.shape[2]
        outs = []
        for b, keys in enumerate(self._plan(context_lens, block_tables, block_size)):
            queries = q[b].view(1, num_kv_heads, q.shape[1] // num_kv_heads, head_dim)
            out = F.scaled_dot_product_attention(queries, k_cache[:, keys][None], v_cache[:, keys][None], scale=scale)
            outs.append(out.reshape(1, q.shape[1], head_dim))
        return torch.cat(outs)


def filled_engine(checkpoint: pathlib.Path, prompt_lens: list[int], vocab: int, max_tokens: int) -> LLMEngine:
    engine = LLMEngine(checkpoint, EngineConfig(
        device="cpu", dtype="bfloat16", enable_prefix_caching=False,
        limits=SchedulerLimits(max_num_seqs=max(len(prompt_lens), 1), max_num_batched_tokens=4096)))
    rng = random.Random(len(prompt_lens))
    for i, n in enumerate(prompt_lens):
        engine.add_request(f"s{i}", [rng.randrange(vocab) for _ in range(n)],
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while any(s.num_uncached_tokens > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    return engine


def step_ms(engines: list[LLMEngine], backend, steps: int) -> list[float]:
    """Median ms of `steps` decode steps of each engine, their steps alternating (the order flipped each time)."""
    times = [[] for _ in engines]
    for engine in engines:
        engine.runner.attention = backend
    for step in range(steps):
        order = range(len(engines)) if step % 2 == 0 else reversed(range(len(engines)))
        for i in order:
            start = time.perf_counter()
            engines[i].step()
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) * 1e3 for t in times]


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds over the backends")
    p.add_argument("--steps", type=int, default=4, help="decode steps per measurement (median taken)")
    p.add_argument("--contexts", default="64,2048", help="single-sequence contexts to compare")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    if args.quick:
        args.repeats, args.steps, batch_sizes, contexts = 1, 2, [1, 4], [16, 64]
    started, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = ensure_checkpoint(pathlib.Path(tmp) / "tiny" if args.quick else args.checkpoint_dir,
                                       "tiny" if args.quick else "qwen3-0.6b")
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        backends = [LoopAttention(), TorchAttention(), default_backend(torch.device("cpu"))]
        budget = args.repeats * len(backends) * args.steps + 2
        results: dict = {"steps_ms": {}, "context_ms": {}}
        # Every batch size's engine is filled first and their steps alternate one by one (the order
        # flipped each time), so the ratios between batch sizes compare the same moments of a noisy machine.
        engines, lens = {}, {}
        for batch in batch_sizes:
            rng = random.Random(batch)
            lens[batch] = [rng.randrange(64, 257) for _ in range(batch)] if not args.quick else [8] * batch
            engines[batch] = filled_engine(checkpoint, lens[batch], vocab, budget)
        step_series = {batch: {b.name: [] for b in backends} for batch in batch_sizes}
        for _ in range(args.repeats):
            for backend in backends:
                for batch, ms in zip(batch_sizes, step_ms([engines[b] for b in batch_sizes], backend, args.steps)):
                    step_series[batch][backend.name].append(ms)
        for batch in batch_sizes:
            results["steps_ms"][batch] = {name: summary(v) for name, v in step_series[batch].items()}
            print(f"batch {batch:3d} (prompts {min(lens[batch])}-{max(lens[batch])}): " + "  ".join(
                f"{name} {statistics.median(v):7.1f} ms" for name, v in step_series[batch].items()), flush=True)
        engines.clear()
        context_series = {n: [] for n in contexts}
        engines = {n: filled_engine(checkpoint, [n], vocab, args.repeats * args.steps + 2) for n in contexts}
        for _ in range(args.repeats):
            for n, ms in zip(contexts, step_ms([engines[n] for n in contexts], backends[-1], args.steps)):
                context_series[n].append(ms)
        results["context_ms"] = {n: summary(v) for n, v in context_series.items()}
        print("one sequence, " + "  ".join(f"context {n}: {statistics.median(v):.1f} ms"
                                           for n, v in context_series.items()))
    # Ratios pair the figures of one round (taken step by step side by side): the median of the
    # per-round ratios.
    default = backends[-1].name
    per_round = {}
    if 1 in step_series and 16 in step_series:
        per_round["step_16_vs_1"] = [a / b for a, b in zip(step_series[16][default], step_series[1][default])]
    for batch in step_series:
        per_round[f"batch_{batch}_{default}_vs_loop"] = [
            a / b for a, b in zip(step_series[batch][default], step_series[batch]["loop"])]
    if len(contexts) == 2:
        per_round[f"context_{contexts[1]}_vs_{contexts[0]}"] = [
            a / b for a, b in zip(context_series[contexts[1]], context_series[contexts[0]])]
    ratios = {name: statistics.median(values) for name, values in per_round.items()}
    for name, value in ratios.items():
        target = TARGETS.get(name)
        verdict = f"  target <= {target}: {'met' if value <= target else 'MISSED'}" if target else ""
        print(f"  {name:32s} {value:6.2f}{verdict}  (per round: {', '.join(f'{v:.2f}' for v in per_round[name])})")
    print(f"load average before: {', '.join(f'{x:.2f}' for x in load_before)}; "
          f"after: {', '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")
    print(json.dumps({"benchmark": "bench_attention", "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(),
                      "threads": torch.get_num_threads(), "torch": torch.__version__},
                      "results": results, "ratios": ratios, "per_round": per_round, "targets": TARGETS,
                      "wall_s": time.perf_counter() - started}))


if __name__ == "__main__":
    main()
