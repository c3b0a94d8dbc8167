"""The paged decode-attention kernel on many short contexts: this tree's build against another commit's,
side by side in one process, on the same inputs.

A decode step's attention call for one layer: `--seqs` sequences (contexts uniform in `--contexts`),
`--heads` query heads over `--kv-heads` KV heads, bf16, block size 16, each sequence's blocks one run of
ids (as the block manager allocates where it can) or, with --scattered, shuffled, or with --shared-prefix N,
the first N blocks of every sequence one shared run (a prompt's cached start) and the rest its own run. Per round each
library runs `--calls` calls (the first flipped each round); prints the median µs per call and per
(sequence, KV head) item, the median of per-round ratios (tree / rev), whether the outputs agree bit
for bit, then one JSON line. Threads: torch's (the kernel shares its OpenMP runtime).

    python -m bench.bench_decode_attention --head-dims 16,32 --threads 1
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from services.model_worker.kernels import cpu_attention  # noqa: E402

KERNEL_DIR = "services/model_worker/kernels"
BLOCK_SIZE = 16


def sources_at(rev: str, directory: pathlib.Path) -> pathlib.Path:
    """paged_attention.c and the headers beside it at `rev`, written into `directory`."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    for path in git("ls-tree", "--name-only", f"{rev}:{KERNEL_DIR}/").split():
        if path == "paged_attention.c" or path.endswith(".h"):
            (directory / path).write_text(git("show", f"{rev}:{KERNEL_DIR}/{path}"))
    return directory / "paged_attention.c"


def inputs(seqs: int, heads: int, kv_heads: int, head_dim: int, contexts: tuple[int, int], scattered: bool,
           seed: int, shared_prefix: int = 0) -> tuple:
    rng = random.Random(seed)
    lens = [rng.randint(*contexts) for _ in range(seqs)]
    # Room to grow past each context, as the block manager keeps it; the shared blocks first.
    counts = [max(-(-n // BLOCK_SIZE) + 1 - shared_prefix, 1) for n in lens]
    ids = list(range(shared_prefix + sum(counts)))
    if scattered:
        rng.shuffle(ids)
    width, tables, at = shared_prefix + max(counts), [], shared_prefix
    for c in counts:
        own = ids[:shared_prefix] + ids[at:at + c]
        tables.append(own + [0] * (width - len(own)))
        at += c
    gen = torch.Generator().manual_seed(seed)
    num_slots = len(ids) * BLOCK_SIZE
    k_cache = torch.randn(kv_heads, num_slots, head_dim, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(kv_heads, num_slots, head_dim, generator=gen).to(torch.bfloat16)
    q = torch.randn(seqs, heads, head_dim, generator=gen).to(torch.bfloat16)
    return (q, k_cache, v_cache, torch.tensor(lens, dtype=torch.int32), torch.tensor(tables, dtype=torch.int32),
            BLOCK_SIZE, head_dim ** -0.5)


def time_calls(library, args: tuple, calls: int) -> float:
    """Median µs of `calls` calls."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        cpu_attention.paged_decode_attention(library, *args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rev", default="HEAD", help="the commit whose kernel is the baseline")
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dims", default="16,32")
    p.add_argument("--contexts", default="16,150", help="min,max context")
    p.add_argument("--scattered", action="store_true", help="shuffle the block ids")
    p.add_argument("--shared-prefix", type=int, default=0, help="blocks every sequence starts with, shared")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=50)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    contexts = tuple(int(x) for x in args.contexts.split(","))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        libraries = {"rev": cpu_attention.load(sources_at(args.rev, pathlib.Path(tmp))), "tree": cpu_attention.load()}
        for head_dim in (int(x) for x in args.head_dims.split(",")):
            data = inputs(args.seqs, args.heads, args.kv_heads, head_dim, contexts, args.scattered, head_dim,
                          args.shared_prefix)
            outs = {name: cpu_attention.paged_decode_attention(lib, *data) for name, lib in libraries.items()}
            same = torch.equal(outs["rev"].view(torch.int16), outs["tree"].view(torch.int16))
            max_diff = (outs["rev"].float() - outs["tree"].float()).abs().max().item()
            series = {name: [] for name in libraries}
            for r in range(args.rounds):
                for name in (("rev", "tree") if r % 2 == 0 else ("tree", "rev")):
                    series[name].append(time_calls(libraries[name], data, args.calls))
            items = args.seqs * args.kv_heads
            medians = {name: statistics.median(v) for name, v in series.items()}
            ratio = statistics.median(t / r for t, r in zip(series["tree"], series["rev"]))
            results[head_dim] = {"us_per_call": medians, "ratio": ratio, "bit_equal": same, "max_diff": max_diff}
            print(f"head_dim {head_dim}: rev {medians['rev']:7.1f} µs ({medians['rev'] / items * 1e3:5.0f} ns/item)"
                  f"  tree {medians['tree']:7.1f} µs ({medians['tree'] / items * 1e3:5.0f} ns/item)"
                  f"  tree/rev {ratio:.3f}  bit-equal {same} (max diff {max_diff:.2g})", flush=True)
    print(json.dumps({"benchmark": "bench_decode_attention", "threads": args.threads, "seqs": args.seqs,
                      "contexts": contexts, "scattered": args.scattered, "shared_prefix": args.shared_prefix,
                      "rev": args.rev, "results": results}))


if __name__ == "__main__":
    main()
