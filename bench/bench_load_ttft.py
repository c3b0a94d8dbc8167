"""First tokens under load, in-process: N concurrent mixed-length streams against the engine alone, per step budget
and admission order.

All N requests arrive at once (fresh random token ids each round, so nothing is cached), and the
engine steps until every one has its max_tokens. Per request: the time to its first token;
overall: output tokens per second. Each round runs every step budget
(`--max-num-batched-tokens`) and admission order (`--scheduling-policy`) asked for on the same
engine, the order reversed every other round, so the machine's drift falls on all of them alike.
Medians over rounds, each setting's ratio to the first one (median of per-round ratios), and one
JSON line at the end. With `--steps`, each run also says where its time went: the steps with prompt
tokens in them, and the pure decode steps by how many sequences they decoded.

Run it from two checkouts, alternating, to compare code before and after a change:

    taskset -c 1 python -m bench.bench_load_ttft --threads 1 --budgets 2048,512 --rounds 3
    taskset -c 1 python -m bench.bench_load_ttft --threads 1 --budgets 768 --policies fcfs,shortest-first
    python -m bench.bench_load_ttft --quick    # a smoke check on a tiny checkpoint
"""
from __future__ import annotations

import argparse
import json
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

from bench.bench_engine import ensure_checkpoint  # noqa: E402
from services.model_worker.config.engine import EngineConfig  # noqa: E402
from services.model_worker.config.sampling import SamplingParams  # noqa: E402
from services.model_worker.engine.llm_engine import LLMEngine  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / ".cache" / "peers-qwen3-0.6b"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_run(engine: LLMEngine, rng: random.Random, args, budget: int, policy: str) -> dict:
    engine.scheduler.limits.max_num_batched_tokens = budget
    engine.scheduler.limits.policy = policy
    vocab = engine.config.vocab_size
    requests = {}
    start = time.perf_counter()
    for i in range(args.streams):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*args.prompt_tokens))]
        max_tokens = rng.randint(*args.output_tokens)
        requests[f"r{i}-{rng.random()}"] = max_tokens
        engine.add_request(list(requests)[-1], prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                       ignore_eos=True))
    first: dict[str, float] = {}
    tokens = steps = 0
    batches = []  # what each step scheduled: the new tokens of each of its sequences
    schedule = engine.scheduler.schedule

    def recorded_schedule():
        batch = schedule()
        batches.append(list(batch.num_tokens))
        return batch

    engine.scheduler.schedule = recorded_schedule
    timed = []  # (seconds, new tokens of each sequence) per step
    try:
        while engine.has_work():
            began = time.perf_counter()
            outputs = engine.step()
            timed.append((time.perf_counter() - began, batches[-1] if batches else []))
            steps += 1
            now = time.perf_counter() - start
            for out in outputs:
                first.setdefault(out.request_id, now)
                tokens += 1
    finally:
        engine.scheduler.schedule = schedule
    wall = time.perf_counter() - start
    assert tokens == sum(requests.values()), (tokens, sum(requests.values()))
    ttft = list(first.values())
    return {"ttft_p50": statistics.median(ttft), "ttft_p90": percentile(ttft, 0.9), "ttft_max": max(ttft),
            "tok_s": tokens / wall, "wall": wall, "steps": steps, "breakdown": step_breakdown(timed)}


def step_breakdown(timed: list[tuple[float, list[int]]]) -> dict:
    """Where a run's time went: the steps with prompt tokens in them, and the pure decode steps by how many
    sequences they decoded (their count and median time)."""
    prompt = [(t, n) for t, n in timed if n and max(n) > 1]
    by_seqs: dict[int, list[float]] = {}
    for t, n in timed:
        if n and max(n) == 1:
            by_seqs.setdefault(len(n), []).append(t)
    return {"prompt_steps": len(prompt), "prompt_s": sum(t for t, _ in prompt),
            "prompt_tokens": sum(sum(n) for _, n in prompt),
            "decode_steps": sum(len(v) for v in by_seqs.values()), "decode_s": sum(sum(v) for v in by_seqs.values()),
            "decode_ms_by_seqs": {b: [len(v), statistics.median(v) * 1e3] for b, v in sorted(by_seqs.items())}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--budgets", default="2048,512", help="step token budgets to compare; ratios are to the first")
    p.add_argument("--policies", default="shortest-first", help="admission orders to compare (shortest-first, "
                   "the worker's default, and fcfs), each at every budget")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=(32, 512))
    p.add_argument("--output-tokens", type=int, nargs=2, default=(32, 128))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", action="store_true", help="also print where each run's time went, step by step kind")
    p.add_argument("--quick", action="store_true", help="a tiny checkpoint and short runs: checks the script works")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    budgets = [int(b) for b in args.budgets.split(",")]
    settings = [(b, policy) for b in budgets for policy in args.policies.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            args.streams, args.rounds, args.prompt_tokens, args.output_tokens = 4, 1, (8, 40), (2, 6)
        checkpoint = ensure_checkpoint(pathlib.Path(tmp) / "tiny" if args.quick else args.checkpoint_dir,
                                       "tiny" if args.quick else "qwen3-0.6b")
        engine = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="bfloat16", enable_prefix_caching=False))
        engine.generate([[1000] * 64], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
        results: dict[tuple, list[dict]] = {s: [] for s in settings}
        for r in range(args.rounds):
            for budget, policy in settings if r % 2 == 0 else settings[::-1]:
                # The same requests for every setting in a round: one seed per round.
                res = one_run(engine, random.Random(args.seed * 1000 + r), args, budget, policy)
                results[budget, policy].append(res)
                print(f"round {r} budget {budget:5d} {policy}: TTFT p50 {res['ttft_p50']:.2f} s "
                      f"p90 {res['ttft_p90']:.2f} s max {res['ttft_max']:.2f} s, {res['tok_s']:.1f} tok/s, "
                      f"{res['steps']} steps, {res['wall']:.1f} s", flush=True)
                if args.steps:
                    b = res["breakdown"]
                    print(f"  steps with prompts: {b['prompt_steps']} ({b['prompt_tokens']} tokens) in "
                          f"{b['prompt_s']:.2f} s; pure decode: {b['decode_steps']} in {b['decode_s']:.2f} s; "
                          "decode steps by sequences (count, median ms): "
                          + ", ".join(f"{k}: {c} x {ms:.0f}" for k, (c, ms) in b["decode_ms_by_seqs"].items()),
                          flush=True)
        engine.close()
    summary = {}
    base = results[settings[0]]
    keys = ("ttft_p50", "ttft_p90", "ttft_max", "tok_s")
    for budget, policy in settings:
        runs = results[budget, policy]
        entry = {key: statistics.median(run[key] for run in runs) for key in keys}
        for key in keys:
            entry[f"{key}_ratio"] = statistics.median(run[key] / b[key] for run, b in zip(runs, base))
        summary[f"{budget}/{policy}"] = entry
        print(f"budget {budget:5d} {policy}: TTFT p50 {entry['ttft_p50']:.2f} s ({entry['ttft_p50_ratio']:.2f}x), "
              f"p90 {entry['ttft_p90']:.2f} s ({entry['ttft_p90_ratio']:.2f}x), "
              f"max {entry['ttft_max']:.2f} s ({entry['ttft_max_ratio']:.2f}x), "
              f"{entry['tok_s']:.1f} tok/s ({entry['tok_s_ratio']:.2f}x)")
    print(json.dumps({"bench": "load_ttft", "streams": args.streams, "prompt_tokens": list(args.prompt_tokens),
                      "output_tokens": list(args.output_tokens), "threads": torch.get_num_threads(),
                      "rounds": args.rounds, "settings": summary}))


if __name__ == "__main__":
    main()
