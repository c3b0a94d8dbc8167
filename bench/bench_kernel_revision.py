"""Prefill and decode steps in the engine with its CPU kernels built from another commit, against the engine
as this tree builds them, side by side in one process on the random Qwen3-0.6B checkpoint: what a kernel
change did to the time to the first token and to a decode step.

The other engine's VNNI matmul, small-batch matmul (the vocabulary projection's, on the plain weight tied to
the embedding), RMSNorm, paged decode-attention and prompt-attention kernels (kernels/vnni_linear.c,
small_batch_linear.c, rms_norm.c, paged_attention.c and prefill_attention.c, each with the headers beside it
at that commit) are compiled from
`--rev`, and its fused decode loop is pointed at them. The weights stay in this tree's layout, so the
revision's matmul kernel must read the same one (every commit since the VNNI order does). Per round, the
two engines take turns (the first flipped each round) on the same fresh prompt of each length, one output
token; then on the same batches of fresh prompts (64 tokens, or `--decode-prompt`), one batch of each size
in `--decode-batches`, whose decode steps (every sequence decoding) are timed. Prints each round, the
median times, the median of per-round ratios (tree / rev), and how many pairs agreed on their tokens (all
of them, for a change that keeps the bits), then one JSON line. Pin it to one CPU for the engine's one-CPU placement:
    taskset -c 1 python -m bench.bench_kernel_revision --threads 1 --rev HEAD~1
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

from bench.bench_engine import DEFAULT_CHECKPOINT, ensure_checkpoint, paired_medians, run_ours  # noqa: E402
from services.model_worker.config.sampling import SamplingParams  # noqa: E402
from services.model_worker.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from services.model_worker.kernels import cpu_attention, cpu_linear, cpu_norm, cpu_prefill_attention  # noqa: E402
from services.model_worker.model.fused_decode import use_fused_decode  # noqa: E402
from services.model_worker.model.layers.attention.cpu_paged import CpuPagedAttention  # noqa: E402
from services.model_worker.model.layers.norm import use_norm_kernel  # noqa: E402

KERNEL_DIR = "services/model_worker/kernels"


def use_vnni(model: torch.nn.Module, library) -> int:
    """Point every layer on the VNNI matmul kernel at `library`; returns how many."""
    layers = [m for m in model.modules() if getattr(m, "vnni", None) is not None]
    for layer in layers:
        layer.vnni = library
    return len(layers)


def use_small_batch(model: torch.nn.Module, library) -> int:
    """Point every layer on the small-batch matmul kernel (the plain weights') at `library`, with the rows it takes;
    returns how many."""
    layers = [m for m in model.modules() if getattr(m, "kernel", None) is not None and hasattr(m, "amx")]
    for layer in layers:
        layer.kernel = library
        layer.small_rows = cpu_linear.small_batch_max_rows(library, layer.in_features)
    return len(layers)


def use_attention(engine: LLMEngine, **libraries) -> int:
    """Point the engine's C attention backend at other kernels, `library` (decodes and the KV writes) or
    `prefill_library` (prompts), keeping the other; returns 1, or 0 where its backend is another."""
    backend = engine.runner.attention
    if not isinstance(backend, CpuPagedAttention):
        return 0
    kept = {"library": backend.library, "prefill_library": backend.prefill_library}
    engine.runner.attention = CpuPagedAttention(**{**kept, **libraries})
    return 1


# name: (the loader, taking the source path; what points an engine at the library)
KERNELS = {"vnni_linear": (cpu_linear.load_vnni, lambda engine, lib: use_vnni(engine.model, lib)),
           "small_batch_linear": (cpu_linear.load, lambda engine, lib: use_small_batch(engine.model, lib)),
           "rms_norm": (cpu_norm.load, lambda engine, lib: use_norm_kernel(engine.model, lib)),
           "paged_attention": (cpu_attention.load, lambda engine, lib: use_attention(engine, library=lib)),
           "prefill_attention": (cpu_prefill_attention.load,
                                 lambda engine, lib: use_attention(engine, prefill_library=lib))}


def decode_steps(engine: LLMEngine, prompts: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    """The median time of the steps in which every one of the prompts' sequences decodes, and their tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    ids = [f"decode-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    times = []
    while engine.has_work():
        started = all(tokens.values())  # every sequence past its prompt: a pure decode step
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        for out in outputs:
            tokens[out.request_id].append(out.token_id)
        if started and len(outputs) == len(prompts):
            times.append(elapsed)
    return statistics.median(times), [tokens[i] for i in ids]


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
    parser.add_argument("--decode-batches", default="1,2,4,8,16", help="sequences per timed decode batch ('' for none)")
    parser.add_argument("--decode-steps", type=int, default=16, help="decode steps per batch")
    parser.add_argument("--decode-prompt", type=int, default=64, help="prompt tokens of each decoding sequence")
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
            if use(engines["rev"], library) == 0:
                raise SystemExit(f"no layer of this engine runs {name} here")
    inner = engines["rev"].model.model
    if inner.fused_decode is not None:  # its kernel table points at the tree's kernels: build it anew
        use_fused_decode(inner, inner.fused_decode.library)
    lengths = [int(t) for t in args.prefill_tokens.split(",") if t]
    batches = [int(b) for b in args.decode_batches.split(",") if b]
    rng = random.Random(0)

    def fresh(tokens: int) -> list[int]:
        return [rng.randrange(1000, 100000) for _ in range(tokens)]

    for engine in engines.values():
        for tokens in lengths:  # warm both: kernels built, caches touched
            run_ours(engine, fresh(tokens), 1)
        for batch in batches:
            decode_steps(engine, [fresh(args.decode_prompt) for _ in range(batch)], args.decode_steps)
    cases = [("prefill", t) for t in lengths] + [("decode", b) for b in batches]
    times = {case: {name: [] for name in engines} for case in cases}
    agreed = dict.fromkeys(cases, 0)
    names = list(engines)
    for r in range(args.rounds):
        for case in cases:
            kind, size = case
            prompts = [fresh(size)] if kind == "prefill" else [fresh(args.decode_prompt) for _ in range(size)]
            got = {}
            for name in names if r % 2 == 0 else names[::-1]:
                if kind == "prefill":
                    run = run_ours(engines[name], prompts[0], 1)
                    times[case][name].append(run.ttft)
                    got[name] = run.tokens
                else:
                    step, got[name] = decode_steps(engines[name], prompts, args.decode_steps)
                    times[case][name].append(step)
            agreed[case] += got["tree"] == got["rev"]
            runs = times[case]
            print(f"round {r} {kind} {size:4d}: tree {runs['tree'][-1] * 1e3:7.1f} ms  rev {runs['rev'][-1] * 1e3:7.1f} ms"
                  f"  tree/rev {runs['tree'][-1] / runs['rev'][-1]:.3f}", flush=True)
    results = {"prefill": {}, "decode": {}}
    for (kind, size), runs in times.items():
        ratio, med = paired_medians(runs, "tree", "rev")
        what = "first tokens" if kind == "prefill" else "tokens"
        print(f"{kind} {size:4d}: tree {med['tree'] * 1e3:7.1f} ms  rev {med['rev'] * 1e3:7.1f} ms  "
              f"tree/rev {ratio:.3f}x  {what} agreed {agreed[(kind, size)]}/{args.rounds}", flush=True)
        results[kind][size] = {"tree_s": med["tree"], "rev_s": med["rev"], "ratio": ratio,
                               "agreed": agreed[(kind, size)]}
    for engine in engines.values():
        engine.close()
    print(json.dumps({"bench": "kernel_revision", "rev": args.rev, "kernels": kernels, "threads": args.threads,
                      "rounds": args.rounds, "decode_steps": args.decode_steps, "decode_prompt": args.decode_prompt,
                      "results": results["prefill"], "decode": results["decode"]}))

if __name__ == "__main__":
    main()
