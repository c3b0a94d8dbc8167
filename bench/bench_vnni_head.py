"""Decode steps with the vocabulary projection in VNNI order (the default with --vnni-weights, its tied embedding
reading the same storage) against the same engine with a plain head, side by side in one process on the random
Qwen3-0.6B checkpoint.

The plain engine's head gets the checkpoint's table back (a second copy, for this comparison only) on the
small-batch kernels, as it ran before the head was reordered; the decoder's layers are the same in both. Per
round, the two engines take turns (the first flipped each round) on the same batch of fresh 64-token prompts of
each size, and the steps in which every sequence decodes are timed. Prints each round, the medians, the median
of per-round ratios (vnni / plain), and how many sequences came out alike, then one JSON line. Pin it to one
CPU for the engine's one-CPU placement:
    taskset -c 1 python -m bench.bench_vnni_head --threads 1
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
from safetensors import safe_open  # noqa: E402
from torch import nn  # noqa: E402

from bench.bench_engine import DEFAULT_CHECKPOINT, ensure_checkpoint, paired_medians  # noqa: E402
from bench.bench_kernel_revision import decode_steps  # noqa: E402
from services.model_worker.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from services.model_worker.model.layers.linear import SmallBatchLinearMethod, VnniLinearMethod  # noqa: E402


def plain_head(engine: LLMEngine, checkpoint: pathlib.Path) -> None:
    """Give the engine's tied head (and embedding) the checkpoint's plain table on the small-batch kernels."""
    model = engine.model
    head = model.lm_head
    if not isinstance(head.method, VnniLinearMethod) or head.vnni is None or not model.config.tie_word_embeddings:
        raise SystemExit("the head is not a tied one in VNNI order here (no AVX512-BF16, or --no-vnni-weights)")
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        table = f.get_tensor("model.embed_tokens.weight").bfloat16().contiguous()
    head.method = SmallBatchLinearMethod(head.method.library, head.method.amx)
    head.vnni = head.vnni_weight = None
    head.weight = nn.Parameter(table, requires_grad=False)
    head.method.process_weights_after_loading(head)
    model.model.embed_tokens.weight = head.weight


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,2,8,16,32,64", help="sequences per timed decode batch")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ensure_checkpoint(args.checkpoint_dir, "qwen3-0.6b")
    config = EngineConfig(device="cpu", dtype="bfloat16", enable_prefix_caching=False)
    engines = {"vnni": LLMEngine(args.checkpoint_dir, config), "plain": LLMEngine(args.checkpoint_dir, config)}
    plain_head(engines["plain"], args.checkpoint_dir)
    batches = [int(b) for b in args.batches.split(",") if b]
    rng = random.Random(0)

    def prompts(count: int) -> list[list[int]]:
        return [[rng.randrange(1000, 100000) for _ in range(64)] for _ in range(count)]

    for engine in engines.values():  # warm both: kernels built, caches touched
        for batch in batches:
            decode_steps(engine, prompts(batch), 8)
    times = {b: {name: [] for name in engines} for b in batches}
    alike = dict.fromkeys(batches, 0)
    names = list(engines)
    for r in range(args.rounds):
        for batch in batches:
            batch_prompts = prompts(batch)
            tokens = {}
            for name in names if r % 2 == 0 else names[::-1]:
                step, tokens[name] = decode_steps(engines[name], batch_prompts, args.decode_steps)
                times[batch][name].append(step)
            alike[batch] += sum(a == b for a, b in zip(tokens["vnni"], tokens["plain"]))
            runs = times[batch]
            print(f"round {r} batch {batch:3d}: vnni {runs['vnni'][-1] * 1e3:7.1f} ms  plain {runs['plain'][-1] * 1e3:7.1f} ms"
                  f"  vnni/plain {runs['vnni'][-1] / runs['plain'][-1]:.3f}", flush=True)
    results = {}
    for batch, runs in times.items():
        ratio, med = paired_medians(runs, "vnni", "plain")
        print(f"batch {batch:3d}: vnni {med['vnni'] * 1e3:7.1f} ms  plain {med['plain'] * 1e3:7.1f} ms  "
              f"vnni/plain {ratio:.3f}x  sequences alike {alike[batch]}/{batch * args.rounds}", flush=True)
        results[batch] = {"vnni_s": med["vnni"], "plain_s": med["plain"], "ratio": ratio, "alike": alike[batch]}
    for engine in engines.values():
        engine.close()
    print(json.dumps({"bench": "vnni_head", "threads": args.threads, "rounds": args.rounds,
                      "decode_steps": args.decode_steps, "results": results}))


if __name__ == "__main__":
    main()
