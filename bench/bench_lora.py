"""16 decode streams over 4 LoRA adapters against 16 streams of the base model alone, on one engine, side by side.

The same LLMEngine (LoRA enabled, 4 adapters of rank --rank on every target module, random weights) runs both, in
rounds that alternate which goes first: --streams greedy requests of --prompt-len random tokens and --new-tokens
each, either all on the base model or spread evenly over the adapters. Decode throughput counts the tokens after
each stream's first over the time from the step that gave every stream its first token to the last step, so the
prefills are left out. The ratio is the median of per-round ratios (adapters / base); the target is >= 0.8.

Both kinds of step run in the fused CPU decode loop (kernels/decoder.c); a step with adapter rows adds the SGMV
kernel (kernels/lora.c) after each target matmul. The default checkpoint is a random one with Qwen3-0.6B's exact
config, in bf16.

    python -m bench.bench_lora                 # 0.6B shape, 16 streams over 4 adapters
    python -m bench.bench_lora --quick         # a tiny checkpoint: checks the script works

The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.bench_engine import cpu_name, ensure_checkpoint, random_prompt  # noqa: E402
from services.model_worker.config.engine import EngineConfig, SchedulerLimits  # noqa: E402
from services.model_worker.config.model import Qwen3Config  # noqa: E402
from services.model_worker.config.sampling import SamplingParams  # noqa: E402
from services.model_worker.engine.llm_engine import LLMEngine  # noqa: E402
from services.model_worker.model.lora.peft_folder import TARGET_MODULES, module_shapes  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / ".cache" / "bench-qwen3-0.6b"


def write_adapter(folder: pathlib.Path, config: Qwen3Config, rank: int, seed: int) -> pathlib.Path:
    """A PEFT folder with random A and B (bf16) on every target module of every layer."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module, (out_features, in_features) in module_shapes(config).items():
            prefix = f"base_model.model.model.layers.{layer}.{TARGET_MODULES[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_features, generator=generator)
                                                  / in_features ** 0.5).bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_features, rank, generator=generator)
                                                  * 0.01).bfloat16()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGET_MODULES),
        "bias": "none"}))
    return folder


def decode_run(engine: LLMEngine, prompts: list[list[int]], adapters: list[str], new_tokens: int) -> float:
    """Decode tok/s of the streams run together: tokens after each stream's first, from when all have one."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [f"bench-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for request_id, prompt, adapter in zip(ids, prompts, adapters):
        engine.add_request(request_id, prompt, params, adapter=adapter)
    counts = dict.fromkeys(ids, 0)
    started = None
    while engine.has_work():
        for out in engine.step():
            counts[out.request_id] += 1
        if started is None and all(counts.values()):
            started, at_start = time.perf_counter(), sum(counts.values())
    return (sum(counts.values()) - at_start) / (time.perf_counter() - started)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint-dir", type=pathlib.Path, default=DEFAULT_CHECKPOINT,
                   help="where the random checkpoint is cached (written on first use)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="base and adapter runs each, alternating")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="a tiny checkpoint and short runs: checks the script works")
    args = p.parse_args(argv)
    if args.quick:
        args.streams, args.adapters, args.rank, args.prompt_len, args.new_tokens, args.rounds = 4, 2, 8, 8, 8, 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        preset = "tiny" if args.quick else "qwen3-0.6b"
        checkpoint = ensure_checkpoint(pathlib.Path(tmp) / "tiny" if args.quick else args.checkpoint_dir, preset)
        config = Qwen3Config.from_json(checkpoint)
        names = [f"adapter-{i}" for i in range(args.adapters)]
        modules = tuple((name, str(write_adapter(pathlib.Path(tmp) / name, config, args.rank, i)))
                        for i, name in enumerate(names))
        memory = dict(kv_cache_bytes=256 << 20) if args.device == "cpu" else dict(gpu_memory_utilization=0.5)
        engine = LLMEngine(checkpoint, EngineConfig(
            device=args.device, dtype="bfloat16", max_model_len=args.prompt_len + args.new_tokens + 16, **memory,
            enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, lora_modules=modules,
            limits=SchedulerLimits(max_num_seqs=max(64, args.streams), max_num_batched_tokens=2048)))
        generator = torch.Generator().manual_seed(0)
        prompts = [random_prompt(args.prompt_len, config.vocab_size, generator) for _ in range(args.streams)]
        spread = [names[i % len(names)] for i in range(args.streams)]
        decode_run(engine, prompts[:2], ["", names[0]], 4)  # warm-up: kernels built, caches touched
        runs: dict[str, list[float]] = {"base": [], "lora": []}
        for round_ in range(args.rounds):
            order = ("base", "lora") if round_ % 2 == 0 else ("lora", "base")
            for which in order:
                runs[which].append(decode_run(engine, prompts, [""] * args.streams if which == "base" else spread,
                                              args.new_tokens))
            print(f"round {round_ + 1}: base {runs['base'][-1]:.1f} tok/s, {args.adapters} adapters "
                  f"{runs['lora'][-1]:.1f} tok/s", file=sys.stderr)
    ratios = [lora / base for lora, base in zip(runs["lora"], runs["base"])]
    median = {name: statistics.median(values) for name, values in runs.items()}
    print(f"{args.streams} streams, decode tok/s (median of {args.rounds}): base {median['base']:.1f}, "
          f"over {args.adapters} adapters (rank {args.rank}) {median['lora']:.1f}; ratio "
          f"{statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}; target >= 0.8)")
    print(json.dumps({
        "benchmark": "bench_lora", "checkpoint": "random, tiny config (--quick)" if args.quick
        else "random, Qwen3-0.6B config", "streams": args.streams, "adapters": args.adapters, "rank": args.rank,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "decode_tok_s": runs,
        "ratio_median": statistics.median(ratios), "ratios": ratios,
        "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "load_average_before": load_before,
                    "load_average_after": os.getloadavg()}}))


if __name__ == "__main__":
    main()
