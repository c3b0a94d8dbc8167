"""Prefill in the engine with its CPU kernels built from another commit, against the engine as this tree
builds them, side by side in one process on the random Qwen3-0.6B checkpoint: what a kernel change did
to the time to the first token.

The other engine's VNNI matmul and RMSNorm kernels (kernels/vnni_linear.c and kernels/rms_norm.c, each
with the headers beside it at that commit) are compiled from `--rev`. The weights stay in this tree's
layout, so the revision's matmul kernel must read the same one (every commit since the VNNI order does).
Per round, the two engines take turns (the first flipped each round) on the same fresh prompt of each
length, one output token. Prints each round, the median times to the first token, the median of
per-round ratios (tree / rev), and how many pairs agreed on the first token (all of them, for a change
that keeps the bits), then one JSON line. Pin it to one CPU for the engine's one-CPU placement:
    taskset -c 1 python -m bench.bench_kernel_revision --threads 1 --rev HEAD~1
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.bench_engine import DEFAULT_CHECKPOINT, ensure_checkpoint, paired_medians, run_ours  # noqa: E402
from services.model_worker.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from services.model_worker.kernels import cpu_linear, cpu_norm  # noqa: E402
from services.model_worker.model.layers.norm import use_norm_kernel  # noqa: E402

KERNEL_DIR = "services/model_worker/kernels"


def use_vnni(model: torch.nn.Module, library) -> int:
    """Point every layer on the VNNI matmul kernel at `library`; returns how many."""
    layers = [m for m in model.modules() if getattr(m, "vnni", None) is not None]
    for layer in layers:
        layer.vnni = library
    return len(layers)


# name: (the loader, taking the source path; what points a model at the library)
KERNELS = {"vnni_linear": (cpu_linear.load_vnni, use_vnni), "rms_norm": (cpu_norm.load, use_norm_kernel)}


def sources_at(rev: str, directory: pathlib.Path) -> None:
    """The kernel directory's C files and headers as they were at `rev`, written into `directory`."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout

    for path in git("ls-tree", "--name-only", f"{rev}:{KERNEL_DIR}").split():
        if path.endswith((".c", ".h")):
            (directory / path).write_text(git("show", f"{rev}:{KERNEL_DIR}/{path}"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="the commit whose kernels the other engine runs")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"of {', '.join(KERNELS)}")
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefill-tokens", default="32,128,512")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    kernels = [k for k in args.kernels.split(",") if k]
    if unknown := set(kernels) - set(KERNELS):
        parser.error(f"unknown kernels: {', '.join(sorted(unknown))}")
    torch.set_num_threads(args.threads)
    ensure_checkpoint(args.checkpoint_dir, "qwen3-0.6b")
    config = EngineConfig(device="cpu", dtype="bfloat16", enable_prefix_caching=False)
    engines = {"tree": LLMEngine(args.checkpoint_dir, config), "rev": LLMEngine(args.checkpoint_dir, config)}
    with tempfile.TemporaryDirectory() as tmp:
        sources_at(args.rev, pathlib.Path(tmp))
        for name in kernels:
            load, use = KERNELS[name]
            library = load(pathlib.Path(tmp) / f"{name}.c")
            if library is None:
                raise SystemExit(f"{name} at {args.rev} does not build or run here")
            if use(engines["rev"].model, library) == 0:
                raise SystemExit(f"no layer of this engine runs {name} here")
    lengths = [int(t) for t in args.prefill_tokens.split(",") if t]
    rng = random.Random(0)
    for engine in engines.values():
        for tokens in lengths:  # warm both: kernels built, caches touched
            run_ours(engine, [rng.randrange(1000, 100000) for _ in range(tokens)], 1)
    times = {t: {name: [] for name in engines} for t in lengths}
    agreed = dict.fromkeys(lengths, 0)
    names = list(engines)
    for r in range(args.rounds):
        for tokens in lengths:
            prompt = [rng.randrange(1000, 100000) for _ in range(tokens)]
            first = {}
            for name in names if r % 2 == 0 else names[::-1]:
                run = run_ours(engines[name], prompt, 1)
                times[tokens][name].append(run.ttft)
                first[name] = run.tokens[0]
            agreed[tokens] += first["tree"] == first["rev"]
            runs = times[tokens]
            print(f"round {r} prefill {tokens:4d}: tree {runs['tree'][-1] * 1e3:7.1f} ms  rev {runs['rev'][-1] * 1e3:7.1f} ms"
                  f"  tree/rev {runs['tree'][-1] / runs['rev'][-1]:.3f}", flush=True)
    results = {}
    for tokens, runs in times.items():
        ratio, med = paired_medians(runs, "tree", "rev")
        print(f"prefill {tokens:4d}: tree {med['tree'] * 1e3:7.1f} ms  rev {med['rev'] * 1e3:7.1f} ms  "
              f"tree/rev {ratio:.3f}x  first tokens agreed {agreed[tokens]}/{args.rounds}", flush=True)
        results[tokens] = {"tree_s": med["tree"], "rev_s": med["rev"], "ratio": ratio, "agreed": agreed[tokens]}
    for engine in engines.values():
        engine.close()
    print(json.dumps({"bench": "kernel_revision", "rev": args.rev, "kernels": kernels, "threads": args.threads,
                      "rounds": args.rounds, "results": results}))


if __name__ == "__main__":
    main()
