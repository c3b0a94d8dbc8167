"""A prompt's first token with the last layer run on the rows the step reads against every row, in one process.

A step with prompts reads the final hidden states of the rows it samples alone (a prompt's last row); the
engine runs the last layer's output projection and MLP on those (`AttentionMetadata.output_rows`). The
baseline is the same engine with every row run to the end (`metadata._output_rows` patched to None for its
turns). Per round, for each prompt length, both take a fresh random prompt, the same for both, one output
token, the order alternating; prints each round, the medians, the median of per-round time ratios
(pruned / every row), and whether both gave the same first token every time. The last line is one JSON object.

    taskset -c 1 python -m bench.bench_last_layer_rows --threads 1 --rounds 7
"""
from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import random
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.bench_engine import DEFAULT_CHECKPOINT, ensure_checkpoint, paired_medians, run_ours  # noqa: E402
from bench.cpu_kind import cpu_description  # noqa: E402
from services.model_worker.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from services.model_worker.model.layers.attention import metadata  # noqa: E402

VARIANTS = ("every row", "pruned")


@contextlib.contextmanager
def every_row():
    real = metadata._output_rows
    metadata._output_rows = lambda host, device: None
    try:
        yield
    finally:
        metadata._output_rows = real


def first_token(engine: LLMEngine, variant: str, prompt: list[int]):
    with every_row() if variant == "every row" else contextlib.nullcontext():
        return run_ours(engine, prompt, 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lengths", default="128,512", help="prompt lengths, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ensure_checkpoint(args.checkpoint_dir, "qwen3-0.6b")
    lengths = [int(n) for n in args.lengths.split(",")]
    engine = LLMEngine(args.checkpoint_dir, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=256,
                                                         enable_prefix_caching=False))
    print(f"CPU {cpu_description()}; {args.threads} thread(s); fused loop "
          f"{'yes' if engine.model.model.fused_decode else 'no'}", flush=True)
    rng = random.Random(0)
    for n in lengths:
        for variant in VARIANTS:
            first_token(engine, variant, [rng.randrange(1000, 100000) for _ in range(n)])  # warm
    times = {n: {v: [] for v in VARIANTS} for n in lengths}
    same = {n: 0 for n in lengths}
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for n in lengths:
            prompt = [rng.randrange(1000, 100000) for _ in range(n)]
            runs = {v: first_token(engine, v, prompt) for v in order}
            for v in VARIANTS:
                times[n][v].append(runs[v].ttft)
            same[n] += runs["pruned"].tokens == runs["every row"].tokens
            print(f"round {r} {n:5d} tokens: " + "  ".join(f"{v} {times[n][v][-1] * 1e3:7.1f} ms" for v in VARIANTS),
                  flush=True)
    results = {}
    for n in lengths:
        ratio, med = paired_medians(times[n], "pruned", "every row")
        print(f"{n:5d} tokens: pruned {med['pruned'] * 1e3:7.1f} ms  every row {med['every row'] * 1e3:7.1f} ms  "
              f"ratio {ratio:.3f}x  same first token {same[n]}/{args.rounds}", flush=True)
        results[n] = {"pruned_ms": med["pruned"] * 1e3, "every_row_ms": med["every row"] * 1e3, "ratio": ratio,
                      "same_first_token": same[n]}
    engine.close()
    print(json.dumps({"bench": "last_layer_rows", "cpu": cpu_description(), "threads": args.threads,
                      "rounds": args.rounds, "results": results}))


if __name__ == "__main__":
    main()
