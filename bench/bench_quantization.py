"""8-bit weights against bf16 through the model worker, side by side, and their agreement with bf16.

Starts one model worker per weight format on the random checkpoint with Qwen3-0.6B's exact config
(bf16 weights; the 8-bit workers quantize them on load, the vocab projection included), then runs,
in interleaved rounds (the order of the formats rotating every round), through each worker's gRPC
Generate:
  - single-stream decode: one greedy request of a 128-token prompt, 64 new tokens; decode tokens/s
    after the first token;
  - 16 streams: 16 greedy requests at once (prompts of 32-256 tokens, 64 new tokens each); output
    tokens/s over the whole run;
  - prefill: the time to the first token of a fresh 512-token prompt (max_tokens 1).
Then each worker's engine-core memory (resident set) and the bytes its weights take. Ratios are the
median of the per-round ratios against bf16.

Agreement with bf16, in process and in bf16, on the soak's eight prompts (bench/soak.py): each 8-bit
model's greedy continuation (64 tokens) against the bf16 model's (the first position where they
differ), and the mean KL(bf16 || 8-bit) of the next-token distributions along the bf16 continuation.
On this random-weight checkpoint the agreement says how far the 8-bit arithmetic moves the logits,
not how a trained model's quality changes.

    python -m bench.bench_quantization                 # about 10 minutes on 2 cores
    python -m bench.bench_quantization --quick         # a smoke check on a tiny checkpoint
"""
from __future__ import annotations

import argparse
import asyncio
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

import grpc  # noqa: E402
import torch  # noqa: E402

from bench.bench_engine import cpu_name, ensure_checkpoint  # noqa: E402
from bench.soak import PROMPTS  # noqa: E402
from services.model_worker.config.model import Qwen3Config  # noqa: E402
from services.model_worker.config.sampling import SamplingParams  # noqa: E402
from services.model_worker.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from services.tokenizer.core import TokenizerCore  # noqa: E402
from tests.integration.stack import Service, child_pids, free_port, wait_serving  # noqa: E402
from tests.unit.test_engine_reference import forward  # noqa: E402
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / ".cache" / "bench-qwen3-0.6b"
FORMATS = {"bf16": [], "int8": ["--quantization", "int8", "--quantize-lm-head"],
           "int8-a16": ["--quantization", "int8", "--quantize-lm-head", "--no-int8-activations"],
           "fp8": ["--quantization", "fp8", "--quantize-lm-head"]}
# The same as EngineConfig fields, for the agreement run in process. int8: activations quantized to int8
# per row (the default); int8-a16: bf16 activations.
ENGINE_FLAGS = {"bf16": {}, "int8": dict(quantization="int8", quantize_lm_head=True),
                "int8-a16": dict(quantization="int8", quantize_lm_head=True, int8_activations=False),
                "fp8": dict(quantization="fp8", quantize_lm_head=True)}
TARGETS = {"decode": 1.5, "streams_16": 1.2, "prefill_time": 1.1}  # prefill: at most 1.1x bf16's time


async def generate(stub, prompt: list[int], new_tokens: int) -> tuple[float, float, int]:
    """(time to the first token, first to last, tokens) of one greedy request."""
    request = worker_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=new_tokens, ignore_eos=True,
                                         sampling=worker_pb2.SamplingParams(temperature=0.0))
    start, stamps = time.perf_counter(), []
    async for _ in stub.Generate(request):
        stamps.append(time.perf_counter())
    return stamps[0] - start, stamps[-1] - stamps[0], len(stamps)


async def single(address: str, prompt: list[int], new_tokens: int) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        _, decode, tokens = await generate(worker_pb2_grpc.ModelWorkerServiceStub(channel), prompt, new_tokens)
    return (tokens - 1) / decode


async def streams(address: str, prompts: list[list[int]], new_tokens: int) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.ModelWorkerServiceStub(channel)
        start = time.perf_counter()
        done = await asyncio.gather(*(generate(stub, p, new_tokens) for p in prompts))
    return sum(tokens for _, _, tokens in done) / (time.perf_counter() - start)


async def prefill(address: str, prompt: list[int]) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        ttft, _, _ = await generate(worker_pb2_grpc.ModelWorkerServiceStub(channel), prompt, 1)
    return ttft


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def weight_bytes(config: Qwen3Config, fmt: str) -> int:
    """What the weights take: embedding and norms in bf16; the linear layers (and head) in 1 or 2 bytes a weight,
    plus float32 scales (int8: one per output row; fp8: one per output row per 128 inputs)."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    linears = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)] * config.num_hidden_layers + [(config.vocab_size, h)]
    norms = config.num_hidden_layers * (2 * h + 2 * d) + h
    embedding = config.vocab_size * h * 2 + norms * 2
    if fmt == "bf16":
        head_shared = config.vocab_size * h * 2 if config.tie_word_embeddings else 0
        return embedding + sum(n * k * 2 for n, k in linears) - head_shared
    scales = sum(n * (1 if fmt.startswith("int8") else -(-k // 128)) * 4 for n, k in linears)
    return embedding + sum(n * k for n, k in linears) + scales


def agreement(checkpoint: pathlib.Path, prompts: list[list[int]], new_tokens: int, formats: list[str]) -> dict:
    """Each 8-bit model against the bf16 one, in process: first greedy divergence and mean KL along bf16's text."""
    def engine(fmt: str) -> LLMEngine:
        return LLMEngine(checkpoint, EngineConfig(device="cpu", dtype="bfloat16", num_blocks=16 * len(prompts) + 64,
                                                  **ENGINE_FLAGS[fmt]))

    greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    base = engine("bf16")
    texts = [base.generate([p], greedy)[0] for p in prompts]
    base_logits = [forward(base, [p + t[:-1]])[0][len(p) - 1:].float() for p, t in zip(prompts, texts)]
    base.close()
    del base
    out = {}
    for fmt in formats:
        ours = engine(fmt)
        divergence, kls = [], []
        for prompt, text, want in zip(prompts, texts, base_logits):
            got = ours.generate([prompt], greedy)[0]
            divergence.append(next((j for j, (a, b) in enumerate(zip(got, text)) if a != b), None))
            logits = forward(ours, [prompt + text[:-1]])[0][len(prompt) - 1:].float()
            kl = torch.nn.functional.kl_div(logits.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                            reduction="none").sum(-1)
            kls.append(kl.mean().item())
        ours.close()
        out[fmt] = {"first_divergence": divergence, "same_text": sum(d is None for d in divergence),
                    "mean_kl": statistics.mean(kls), "max_prompt_kl": max(kls)}
    return out


def print_agreement(agree: dict, new_tokens: int) -> None:
    for fmt, a in agree.items():
        print(f"  {fmt} vs bf16 on the {len(PROMPTS)} soak prompts, {new_tokens} greedy tokens: first "
              f"divergence at {a['first_divergence']} (None: the same text), mean KL {a['mean_kl']:.4g} "
              f"(worst prompt {a['max_prompt_kl']:.4g})", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", type=pathlib.Path, default=DEFAULT_CHECKPOINT)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--kv-cache-bytes", default="512MiB", help="each worker's KV cache")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated: bf16 first, then 8-bit ones")
    p.add_argument("--skip-agreement", action="store_true")
    p.add_argument("--agreement-only", action="store_true", help="only the agreement with bf16, no workers")
    p.add_argument("--quick", action="store_true", help="a tiny checkpoint, short prompts, one round")
    args = p.parse_args(argv)
    started, load_before = time.perf_counter(), os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="bench-quant-")
    checkpoint = ensure_checkpoint(pathlib.Path(tmp) / "tiny" if args.quick else args.checkpoint,
                                   "tiny" if args.quick else "qwen3-0.6b")
    config = Qwen3Config.from_json(checkpoint)
    lengths = (16, 32, 8) if args.quick else (128, 512, 64)
    if args.quick:
        args.repeats, args.new_tokens = 1, 8
    formats = args.formats.split(",")
    if formats[0] != "bf16" or not set(formats) <= set(FORMATS):
        p.error(f"--formats: bf16 first, then any of {', '.join(FORMATS)}")
    if args.agreement_only:
        tokenizer = TokenizerCore.from_dir(checkpoint)
        agree = agreement(checkpoint, [tokenizer.encode(t) for t in PROMPTS], args.new_tokens, formats[1:])
        print_agreement(agree, args.new_tokens)
        print(json.dumps({"benchmark": "bench_quantization", "agreement": agree, "formats": formats,
                          "load_average_before": load_before, "load_average_after": os.getloadavg()}))
        return
    rng = random.Random(0)

    def ids(n: int) -> list[int]:  # fresh random tokens: no prefix-cache hit between formats or rounds
        return [rng.randrange(1000, config.vocab_size - 1000) for _ in range(n)]

    print(f"{', '.join(formats)} workers on {checkpoint}; {args.repeats} rounds; load average "
          f"{' '.join(f'{x:.2f}' for x in load_before)} on {os.cpu_count()} CPUs", flush=True)
    workers = {}
    for fmt in formats:
        workers[fmt] = Service(f"worker-{fmt}", [
            "services.model_worker", "--model", str(checkpoint), "--dtype", "bfloat16", "--kv-cache-bytes",
            args.kv_cache_bytes, *FORMATS[fmt]], free_port(), f"{tmp}/worker-{fmt}.log")
    results: dict[str, dict[str, list[float]]] = {f: {"decode": [], "streams_16": [], "prefill_time": []}
                                                  for f in formats}
    memory = {}
    try:
        for worker in workers.values():  # one at a time: loading is the memory peak
            worker.start()
            wait_serving(worker.address, timeout=900)
        single_prompt = ids(lengths[0])
        for fmt, worker in workers.items():  # warm: first calls pay one-time costs
            asyncio.run(single(worker.address, single_prompt, 4))
        for round_ in range(args.repeats):
            order = formats[round_ % len(formats):] + formats[:round_ % len(formats)]
            for fmt in order:
                address = workers[fmt].address
                results[fmt]["decode"].append(asyncio.run(single(address, ids(lengths[0]), args.new_tokens)))
                prompts = [ids(rng.choice((32, 64, 128, 256)) if not args.quick else 8) for _ in range(16)]
                results[fmt]["streams_16"].append(asyncio.run(streams(address, prompts, args.new_tokens)))
                results[fmt]["prefill_time"].append(asyncio.run(prefill(address, ids(lengths[1]))))
            print(f"round {round_ + 1}: " + "  ".join(
                f"{f} {r['decode'][-1]:.1f} tok/s, 16 streams {r['streams_16'][-1]:.0f} tok/s, prefill "
                f"{r['prefill_time'][-1] * 1e3:.0f} ms" for f, r in results.items()), flush=True)
        for fmt, worker in workers.items():
            (core,) = child_pids(worker.process.pid)
            memory[fmt] = {"engine_core_rss": rss_bytes(core), "weights": weight_bytes(config, fmt)}
    finally:
        for worker in workers.values():
            worker.stop()

    def paired(fmt: str, key: str) -> list[float]:
        return [a / b for a, b in zip(results[fmt][key], results["bf16"][key])]

    print(f"\n{'':9s}{'decode tok/s':>24s}{'16 streams tok/s':>24s}{'prefill 512 ms':>22s}{'weights GB':>12s}"
          f"{'core RSS GB':>13s}")
    for fmt, r in results.items():
        cells = []
        for key, scale in (("decode", 1), ("streams_16", 1), ("prefill_time", 1e3)):
            v = [x * scale for x in r[key]]
            cells.append(f"{statistics.median(v):9.1f} ({min(v):.1f}-{max(v):.1f})")
        print(f"{fmt:9s}{cells[0]:>24s}{cells[1]:>24s}{cells[2]:>22s}{memory[fmt]['weights'] / 1e9:12.3f}"
              f"{memory[fmt]['engine_core_rss'] / 1e9:13.3f}")
    ratios = {}
    for fmt in formats[1:]:
        for key in ("decode", "streams_16", "prefill_time"):
            values = paired(fmt, key)
            ratios[f"{fmt}/{key}"] = statistics.median(values)
            target = TARGETS[key]
            met = ratios[f"{fmt}/{key}"] <= target if key == "prefill_time" else ratios[f"{fmt}/{key}"] >= target
            print(f"  {fmt} vs bf16, {key:13s} {ratios[f'{fmt}/{key}']:5.2f}  target {'<=' if key == 'prefill_time' else '>='}"
                  f" {target}: {'met' if met else 'MISSED'}  (per round: {', '.join(f'{v:.2f}' for v in values)})")
    agree = None
    if not args.skip_agreement:
        tokenizer = TokenizerCore.from_dir(checkpoint)
        agree = agreement(checkpoint, [tokenizer.encode(t) for t in PROMPTS], args.new_tokens, formats[1:])
        print_agreement(agree, args.new_tokens)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(json.dumps({"benchmark": "bench_quantization", "machine": {
        "cpu": cpu_name(), "cpus": os.cpu_count(), "torch": torch.__version__, "load_average_before": load_before,
        "load_average_after": os.getloadavg()}, "settings": {"repeats": args.repeats, "new_tokens": args.new_tokens,
        "prompt_lengths": lengths, "formats": {f: FORMATS[f] for f in formats}}, "results": results,
        "memory": memory, "ratios": ratios, "agreement": agree, "targets": TARGETS,
        "wall_s": time.perf_counter() - started}))


if __name__ == "__main__":
    main()
