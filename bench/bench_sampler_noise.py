"""The sampler's noise: torch's exponential_ (a generator's stream) against the counter-based hash
(executor/random_draws.py), for rows x vocabulary shapes, taking turns within each round.

Prints the median and range over rounds of each path's time per call, and their ratio, then one JSON line:
    python -m bench.bench_sampler_noise --threads 2 --rows 1,64,256 --vocab 512,151936
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from services.model_worker.executor import random_draws


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,64,256")
    parser.add_argument("--vocab", default="512,151936")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for vocab in map(int, args.vocab.split(",")):
        ids = torch.arange(vocab)
        for rows in map(int, args.rows.split(",")):
            draws = [(seed, 7) for seed in range(rows)]
            paths = {
                "exponential_": lambda: torch.empty(rows, vocab).exponential_(),
                # The keys as the sampler makes them every step, then the noise.
                "hash": lambda: random_draws.exponential(
                    random_draws.draw_words(draws, random_draws.SAMPLE, torch.device("cpu")), ids),
            }
            repeat = max(1, 2_000_000 // (rows * vocab))
            times = {name: [] for name in paths}
            for r in range(args.rounds + 1):
                for name in (list(paths) if r % 2 else list(paths)[::-1]):
                    start = time.perf_counter()
                    for _ in range(repeat):
                        paths[name]()
                    if r:  # the first round warms up
                        times[name].append((time.perf_counter() - start) / repeat * 1e3)
            row = {"rows": rows, "vocab": vocab}
            for name, t in times.items():
                row[name] = {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t)}
            row["hash_over_exponential"] = statistics.median(
                h / e for h, e in zip(times["hash"], times["exponential_"]))
            results.append(row)
            print(f"{rows:>4} x {vocab:>6}: exponential_ {row['exponential_']['median_ms']:9.3f} ms "
                  f"({row['exponential_']['min_ms']:.3f}-{row['exponential_']['max_ms']:.3f}), "
                  f"hash {row['hash']['median_ms']:9.3f} ms ({row['hash']['min_ms']:.3f}-{row['hash']['max_ms']:.3f}), "
                  f"ratio {row['hash_over_exponential']:.2f}", flush=True)
    print(json.dumps({"threads": args.threads, "results": results}))


if __name__ == "__main__":
    main()
