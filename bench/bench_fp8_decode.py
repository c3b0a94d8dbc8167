"""fp8 weights at one decode row against bf16: the kernels' bytes a second, and one stream's decode speed in the engine.

Kernels: one decode step's matmuls of Qwen3-0.6B-shaped random weights (qkv, o, gate_up, down, 28 times
over), then the vocabulary projection (151,936 x 1,024) alone, one input row, each kernel in turn every
round: fp8 (q8_linear.c), bf16 in the VNNI order the engine's layers hold (vnni_linear.c) and bf16 on the
plain weight (small_batch_linear.c's one-row kernel, the head's). GB/s counts the bytes each must read: the
weights, and fp8's float32 scales. `--rev` adds fp8 with q8_linear.c (and the headers beside it) as that
commit has them, here and in the engine.

Engine: the random Qwen3-0.6B checkpoint in process, one greedy request at a time (a fresh prompt, then
--new-tokens tokens), bf16, fp8 (--quantization fp8) and fp8 with the head in fp8 (--quantize-lm-head),
in turns, the order rotating each round. Decode tokens/s counts the tokens after the first.

Medians (min-max) over the rounds, and the median of the per-round ratios to bf16.

    python -m bench.bench_fp8_decode --threads 2 --rounds 15
    python -m bench.bench_fp8_decode --rev HEAD --skip-engine     # the kernel before and after a change
"""
from __future__ import annotations

import argparse
import os
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

from bench.bench_engine import DEFAULT_CHECKPOINT, cpu_name, ensure_checkpoint, run_ours  # noqa: E402
from services.model_worker.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from services.model_worker.kernels import build, cpu_linear, cpu_q8_linear  # noqa: E402

LAYERS = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)] * 28  # (out, in): qkv, o, gate_up, down
HEAD = [(151936, 1024)]
KERNEL_DIR = ROOT / "services" / "model_worker" / "kernels"


def source_at(rev: str) -> pathlib.Path:
    """q8_linear.c and its headers as commit `rev` has them, in a folder of their own."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="fp8-rev-"))
    names = subprocess.run(["git", "ls-tree", "--name-only", rev, "services/model_worker/kernels/"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split()
    for path in [n for n in names if n.endswith((".h", "/q8_linear.c"))]:
        text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout
        (folder / pathlib.Path(path).name).write_text(text)
    return folder / "q8_linear.c"


def kernels_at(rev: str) -> cpu_q8_linear.Q8Kernels:
    library = build.load(source_at(rev), f"q8_linear at {rev}")
    library.q8_linear.argtypes = cpu_q8_linear._ARGS
    library.q8_linear.restype = cpu_q8_linear.ctypes.c_int
    return cpu_q8_linear.Q8Kernels(library, False)


def kernel_rates(shapes, rounds: int, rev: str | None) -> dict[str, list[float]]:
    """GB/s of each kernel over `shapes`, one input row, per round."""
    gen = torch.Generator().manual_seed(0)
    q8, plain, vnni = cpu_q8_linear.load(), cpu_linear.load(), cpu_linear.load_vnni()
    fp8 = [((torch.randn(n, k, generator=gen) * 40).to(torch.float8_e4m3fn), torch.rand(n, k // 128, generator=gen))
           for n, k in shapes]
    bf16 = [torch.randn(n, k, generator=gen).bfloat16() for n, k in shapes]
    packed = [cpu_linear.vnni_pack_(vnni, w.clone()) for w in bf16] if vnni is not None and len(shapes) > 1 else None
    xs = {k: torch.randn(1, k, generator=gen).bfloat16() for _, k in shapes}
    runs = {"fp8": lambda i, x: cpu_q8_linear.linear(q8, x, *fp8[i], 128, amx=False),
            "bf16-plain": lambda i, x: cpu_linear.small_batch_linear(plain, x, bf16[i])}
    if packed is not None:
        runs["bf16-vnni"] = lambda i, x: cpu_linear.vnni_linear(vnni, x, packed[i])
    if rev is not None:
        old = kernels_at(rev)
        runs[f"fp8@{rev}"] = lambda i, x: cpu_q8_linear.linear(old, x, *fp8[i], 128, amx=False)
    fp8_bytes = sum(n * k + n * (k // 128) * 4 for n, k in shapes)
    bf16_bytes = sum(n * k * 2 for n, k in shapes)
    rates = {name: [] for name in runs}
    for r in range(rounds):
        names = list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]
        for name in names:
            start = time.perf_counter()
            for i, (_, k) in enumerate(shapes):
                runs[name](i, xs[k])
            rates[name].append((fp8_bytes if name.startswith("fp8") else bf16_bytes) / (time.perf_counter() - start) / 1e9)
    return rates


def engine_rates(checkpoint: pathlib.Path, rounds: int, new_tokens: int, prompt_tokens: int,
                 rev: str | None) -> dict[str, list[float]]:
    """Decode tokens/s of one stream, per round, for bf16, fp8 and fp8 with the head in fp8 (and both with
    q8_linear.c at `rev`: the engine loads the kernels as it starts, so it keeps the ones it found)."""
    flags = {"bf16": {}, "fp8": dict(quantization="fp8"), "fp8+head": dict(quantization="fp8", quantize_lm_head=True)}
    engines = {name: LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=64, **f))
               for name, f in flags.items()}
    if rev is not None:
        tree_source, cpu_q8_linear.SOURCE = cpu_q8_linear.SOURCE, source_at(rev)
        try:
            for name in ("fp8", "fp8+head"):
                engines[f"{name}@{rev}"] = LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="bfloat16",
                                                                              num_blocks=64, **flags[name]))
        finally:
            cpu_q8_linear.SOURCE = tree_source
    vocab, rng = 151936, random.Random(0)
    rates = {name: [] for name in engines}
    for r in range(rounds):
        names = list(engines)[r % len(engines):] + list(engines)[:r % len(engines)]
        for name in names:
            prompt = [rng.randrange(vocab) for _ in range(prompt_tokens)]  # fresh: no prefix-cache hits
            rates[name].append(run_ours(engines[name], prompt, new_tokens).decode_tps)
    for engine in engines.values():
        engine.close()
    return rates


def report(title: str, unit: str, rates: dict[str, list[float]], base: str) -> None:
    print(title)
    for name, values in rates.items():
        ratio = statistics.median(a / b for a, b in zip(values, rates[base]))
        print(f"  {name:12s} {statistics.median(values):7.2f} {unit} ({min(values):.2f}-{max(values):.2f})   "
              f"/ {base}: {ratio:.3f}", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--engine-rounds", type=int, default=7)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=16, help="fresh random tokens a request starts from")
    p.add_argument("--rev", help="also time fp8 with q8_linear.c at this commit (e.g. HEAD: before a change)")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--checkpoint", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{cpu_name()}, {args.threads} threads, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on "
          f"{os.cpu_count()} CPUs; {args.rounds} rounds in turns")
    if not args.skip_kernels:
        report("0.6B decoder matmuls, one row (GB/s read)", "GB/s", kernel_rates(LAYERS, args.rounds, args.rev),
               "bf16-vnni" if cpu_linear.load_vnni() is not None else "bf16-plain")
        report("vocabulary projection, one row (GB/s read)", "GB/s", kernel_rates(HEAD, args.rounds, args.rev),
               "bf16-plain")
    if not args.skip_engine:
        checkpoint = ensure_checkpoint(args.checkpoint, "qwen3-0.6b")
        report(f"engine, one stream, {args.prompt_tokens}-token prompts, {args.new_tokens} tokens (decode tok/s; "
               f"{args.engine_rounds} rounds)", "tok/s",
               engine_rates(checkpoint, args.engine_rounds, args.new_tokens, args.prompt_tokens, args.rev), "bf16")


if __name__ == "__main__":
    main()
