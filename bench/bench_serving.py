"""Serving benchmark: concurrent mixed-length streams through the real gateway against transformers' generate.

Starts the tokenizer, model worker and gateway as subprocesses on a random checkpoint with
Qwen3-0.6B's exact config (bf16), then measures, on the same requests:
  - the gateway under N concurrent gRPC clients: output tokens/s, TTFT and TPOT percentiles
    (run twice, alternating with the baselines since the machines drift; the second run has
    the same lengths with other words, so it gains nothing from the prefix cache);
  - transformers `generate` one request at a time, and as a left-padded static batch of 8;
  - TTFT of a chat request whose 512-token system prompt is already cached, against one whose
    system prompt is new (interleaved pairs).
The gateway's ratio to the static batch and the prefix-hit TTFT ratio are medians of the
per-pair ratios. The last line printed is one JSON object with the figures and ratios.

    python -m bench.bench_serving            # the full run (under ~10 minutes on 2 CPU cores)
    python -m bench.bench_serving --quick    # a smoke check
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from demo.checkpoint import build_demo_checkpoint  # noqa: E402
from services.tokenizer.core import TokenizerCore  # noqa: E402
from tests.integration.stack import make_stack  # noqa: E402
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402

DEFAULT_CHECKPOINT = ROOT / ".cache" / "serving-qwen3-0.6b"
PAD_ID = 151643  # <|endoftext|>
TARGET_VS_STATIC_BATCH = 3.0
TARGET_PREFIX_TTFT_RATIO = 0.25


@dataclass
class Request:
    text: str
    prompt_ids: list[int]
    max_tokens: int


@dataclass
class Timing:
    start: float
    first_token: float
    end: float
    tokens: int

    @property
    def ttft(self) -> float:
        return self.first_token - self.start

    @property
    def tpot(self) -> float | None:
        return (self.end - self.first_token) / (self.tokens - 1) if self.tokens > 1 else None


# -- workload -----------------------------------------------------------------------------------------


def word_pool(tokenizer: TokenizerCore) -> list[str]:
    """Vocabulary entries that are a space and a short lowercase word: about one token each in any order."""
    return sorted(" " + token[1:] for token in tokenizer.tokenizer.get_vocab() if re.fullmatch(r"Ġ[a-z]{3,9}", token))


def make_text(rng: random.Random, words: list[str], tokenizer: TokenizerCore, num_tokens: int) -> str:
    text = "".join(rng.choice(words) for _ in range(num_tokens))
    while len(tokenizer.encode(text)) > num_tokens:  # a rare merge across words; trim to the target
        text = text[:text.rindex(" ")]
    return text


def make_requests(rng: random.Random, words, tokenizer, count: int, prompt_range, output_range) -> list[Request]:
    requests = []
    for _ in range(count):
        text = make_text(rng, words, tokenizer, rng.randint(*prompt_range))
        requests.append(Request(text, tokenizer.encode(text), rng.randint(*output_range)))
    return requests


def same_shapes(rng: random.Random, words, tokenizer, requests: list[Request]) -> list[Request]:
    """Requests of the same prompt and output lengths with other words: a rerun that finds nothing cached."""
    out = []
    for req in requests:
        text = make_text(rng, words, tokenizer, len(req.prompt_ids))
        out.append(Request(text, tokenizer.encode(text), req.max_tokens))
    return out


# -- through the gateway ------------------------------------------------------------------------------


async def timed_stream(stub, request: gateway_pb2.GenerateRequest) -> Timing:
    start = time.perf_counter()
    first, tokens = None, 0
    async for message in stub.Generate(request):
        if message.token_ids:
            tokens += len(message.token_ids)
            first = first or time.perf_counter()
    return Timing(start, first, time.perf_counter(), tokens)


def text_request(req: Request) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=req.text, max_tokens=req.max_tokens, temperature=0, ignore_eos=True)


def chat_request(system: str, user: str, max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(role="system", content=system),
                  gateway_pb2.ChatMessage(role="user", content=user)],
        enable_thinking=False, max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def run_gateway(address: str, requests: list[Request], concurrency: int) -> tuple[list[Timing], float]:
    """N clients, each sending its next request as soon as the last one finished."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        queue: asyncio.Queue = asyncio.Queue()
        for req in requests:
            queue.put_nowait(req)
        timings: list[Timing] = []

        async def client():
            while not queue.empty():
                req = queue.get_nowait()
                timing = await timed_stream(stub, text_request(req))
                assert timing.tokens == req.max_tokens, (timing.tokens, req.max_tokens)
                timings.append(timing)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return timings, time.perf_counter() - start


async def prefix_ttft(address: str, rng, words, tokenizer, pairs: int, system_tokens: int) -> tuple[list, list]:
    """TTFT of a chat whose system prompt is cached, and of one whose system prompt is new, interleaved."""
    shared = make_text(rng, words, tokenizer, system_tokens)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        await timed_stream(stub, chat_request(shared, "hello", 2))  # puts the shared prompt in the cache
        hits, misses = [], []
        for i in range(pairs):
            user = make_text(rng, words, tokenizer, 24)
            fresh = make_text(rng, words, tokenizer, system_tokens)
            misses.append((await timed_stream(stub, chat_request(fresh, user, 2))).ttft)
            hits.append((await timed_stream(stub, chat_request(shared, user, 2))).ttft)
        return hits, misses


# -- transformers -------------------------------------------------------------------------------------


def load_reference(checkpoint: pathlib.Path, batch_size: int, prompt_len: int):
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None  # every request runs to its max_tokens, as with ignore_eos
    model.generation_config.pad_token_id = PAD_ID
    with torch.inference_mode():  # the same one-time costs as the gateway's warm-up, at full size
        for batch in (batch_size, 1):
            model.generate(torch.full((batch, prompt_len), 1000), attention_mask=torch.ones(batch, prompt_len,
                           dtype=torch.long), max_new_tokens=2, do_sample=False)
    return model


@torch.inference_mode()
def hf_one_at_a_time(model, requests: list[Request]) -> tuple[int, float]:
    tokens, start = 0, time.perf_counter()
    for req in requests:
        out = model.generate(torch.tensor([req.prompt_ids]), max_new_tokens=req.max_tokens, do_sample=False)
        tokens += out.shape[1] - len(req.prompt_ids)
    return tokens, time.perf_counter() - start


@torch.inference_mode()
def hf_static_batches(model, requests: list[Request], batch_size: int) -> tuple[int, int, float]:
    """Left-padded batches, each run to its longest request. Returns (requested tokens, generated, seconds)."""
    useful = generated = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[PAD_ID] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        steps = max(r.max_tokens for r in batch)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, do_sample=False)
        assert out.shape[1] - width == steps
        useful += sum(r.max_tokens for r in batch)
        generated += steps * len(batch)
    return useful, generated, time.perf_counter() - start


# -- report -------------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def summarize(name: str, timings: list[Timing], wall: float) -> dict:
    tokens = sum(t.tokens for t in timings)
    ttfts = [t.ttft for t in timings]
    tpots = [t.tpot for t in timings if t.tpot is not None]
    row = {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "ttft_p50_s": pct(ttfts, 50),
           "ttft_p99_s": pct(ttfts, 99), "tpot_p50_s": pct(tpots, 50), "tpot_p99_s": pct(tpots, 99)}
    print(f"{name}: {tokens} tokens in {wall:.1f} s = {row['tok_s']:.1f} tok/s; "
          f"TTFT p50 {row['ttft_p50_s']:.2f} s, p99 {row['ttft_p99_s']:.2f} s; "
          f"TPOT p50 {row['tpot_p50_s'] * 1e3:.0f} ms, p99 {row['tpot_p99_s'] * 1e3:.0f} ms", flush=True)
    return row


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_serving", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=pathlib.Path, default=DEFAULT_CHECKPOINT,
                        help="Qwen3 checkpoint directory; written (random weights, Qwen3-0.6B shape) if missing")
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent gRPC clients")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(64, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    parser.add_argument("--one-at-a-time", type=int, default=3,
                        help="how many of the requests transformers runs one at a time (it is slow)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="transformers' static batch (one batch: the first requests)")
    parser.add_argument("--system-prompt-tokens", type=int, default=512)
    parser.add_argument("--prefix-pairs", type=int, default=5, help="(miss, hit) TTFT pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker-flag", action="append", default=[],
                        help="extra model worker flag, e.g. --worker-flag=--max-num-seqs=32 (repeatable)")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.concurrency, args.one_at_a_time, args.prefix_pairs, args.batch_size = 4, 4, 1, 2, 4
        args.prompt_tokens, args.output_tokens = (16, 64), (8, 16)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not (args.checkpoint / "model.safetensors").exists():
        print(f"writing a random Qwen3-0.6B checkpoint to {args.checkpoint}", flush=True)
        build_demo_checkpoint(args.checkpoint, "qwen3-0.6b", "bfloat16", seed=args.seed)
    tokenizer = TokenizerCore.from_dir(args.checkpoint)
    rng = random.Random(args.seed)
    words = word_pool(tokenizer)
    requests = make_requests(rng, words, tokenizer, args.num_requests, args.prompt_tokens, args.output_tokens)
    print(f"{len(requests)} requests: prompts {min(len(r.prompt_ids) for r in requests)}-"
          f"{max(len(r.prompt_ids) for r in requests)} tokens, outputs {min(r.max_tokens for r in requests)}-"
          f"{max(r.max_tokens for r in requests)} tokens, {sum(r.max_tokens for r in requests)} in all; "
          f"{args.concurrency} concurrent clients; torch {torch.__version__}, {torch.get_num_threads()} threads",
          flush=True)

    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs "
          "(other work on the machine skews every figure)", flush=True)
    log_dir = tempfile.mkdtemp(prefix="bench-serving-")
    stack = make_stack(str(args.checkpoint), log_dir, worker_flags=["--dtype", "bfloat16", *args.worker_flag])
    began = time.perf_counter()
    stack.start(timeout=600)
    print(f"services up in {time.perf_counter() - began:.0f} s (logs in {log_dir})", flush=True)
    address = stack.gateway.address
    try:
        # Warm-up at full size (the same prompt lengths, a few tokens each): the first large prefill
        # pays one-time costs (allocations, kernel setup) that would otherwise land in run 1.
        began = time.perf_counter()
        warmup = [Request(r.text, r.prompt_ids, 4) for r in same_shapes(random.Random(args.seed + 1), words,
                                                                       tokenizer, requests)]
        asyncio.run(run_gateway(address, warmup, args.concurrency))
        print(f"warm-up: {time.perf_counter() - began:.0f} s", flush=True)

        # Gateway runs alternate with transformers' static batches, so a drift in the machine's speed hits both.
        model = load_reference(args.checkpoint, args.batch_size, max(len(r.prompt_ids) for r in requests))
        gateway_runs, static_runs = [], []
        batches = [requests[i:i + args.batch_size] for i in range(0, len(requests), args.batch_size)]
        for run in range(2):
            run_requests = requests if run == 0 else same_shapes(rng, words, tokenizer, requests)
            gateway_runs.append(summarize(f"gateway, run {run + 1}" + (" (same lengths, new prompts)" if run else ""),
                                          *asyncio.run(run_gateway(address, run_requests, args.concurrency))))
            batch = batches[run % len(batches)]
            useful, generated, wall = hf_static_batches(model, batch, args.batch_size)
            static_runs.append({"tokens": useful, "generated": generated, "wall_s": wall})
            print(f"transformers, static batch {run + 1} ({len(batch)} requests, left-padded, run to the longest): "
                  f"{useful} requested tokens in {wall:.1f} s = {useful / wall:.1f} tok/s "
                  f"({generated / wall:.1f} tok/s counting rows run past their max_tokens)", flush=True)
        wall = sum(r["wall_s"] for r in static_runs)
        static = {"tok_s": sum(r["tokens"] for r in static_runs) / wall,
                  "generated_tok_s": sum(r["generated"] for r in static_runs) / wall, "runs": static_runs}

        tokens, wall = hf_one_at_a_time(model, requests[:args.one_at_a_time])
        one = {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall}
        print(f"transformers, one at a time ({args.one_at_a_time} requests): {tokens} tokens in {wall:.1f} s = "
              f"{one['tok_s']:.1f} tok/s", flush=True)
        del model

        hits, misses = asyncio.run(prefix_ttft(address, rng, words, tokenizer, args.prefix_pairs,
                                               args.system_prompt_tokens))
        print(f"prefix cache: TTFT with a cached {args.system_prompt_tokens}-token system prompt "
              f"{statistics.median(hits):.3f} s (runs {', '.join(f'{h:.3f}' for h in hits)}); "
              f"with a new one {statistics.median(misses):.3f} s (runs {', '.join(f'{m:.3f}' for m in misses)})",
              flush=True)
    finally:
        stack.stop()
    stats_lines = [line for line in stack.worker.log().splitlines() if "tokens/s generated" in line]
    if stats_lines:
        print(f"worker's last stats line: {stats_lines[-1]}")
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")

    gateway_tok_s = statistics.median(run["tok_s"] for run in gateway_runs)
    # Both comparisons run in pairs, back to back: each ratio is the median of the pairs' ratios.
    ratio_per_pair = [g["tok_s"] / (h["tokens"] / h["wall_s"]) for g, h in zip(gateway_runs, static_runs)]
    prefix_ratio = statistics.median(hit / miss for hit, miss in zip(hits, misses))
    result = {
        "num_requests": len(requests), "concurrency": args.concurrency, "quick": args.quick,
        "gateway_tok_s": gateway_tok_s, "gateway_runs": gateway_runs,
        "hf_static_batch_tok_s": static["tok_s"], "hf_static_batch_generated_tok_s": static["generated_tok_s"],
        "hf_static_batch_runs": static["runs"],
        "ratio_per_pair": ratio_per_pair,
        "hf_one_at_a_time_tok_s": one["tok_s"],
        "ratio_vs_static_batch": statistics.median(ratio_per_pair),
        "ratio_vs_static_batch_generated": gateway_tok_s / static["generated_tok_s"],
        "ratio_vs_one_at_a_time": gateway_tok_s / one["tok_s"],
        "prefix_ttft_hit_s": statistics.median(hits), "prefix_ttft_miss_s": statistics.median(misses),
        "prefix_ttft_ratio": prefix_ratio, "load_average_after": os.getloadavg()[0],
    }
    result["targets_met"] = {
        f"gateway >= {TARGET_VS_STATIC_BATCH}x static batch": result["ratio_vs_static_batch"] >= TARGET_VS_STATIC_BATCH,
        f"prefix-hit TTFT <= {TARGET_PREFIX_TTFT_RATIO}x miss": prefix_ratio <= TARGET_PREFIX_TTFT_RATIO,
    }
    low, high = min(result["ratio_per_pair"]), max(result["ratio_per_pair"])
    if high > 1.25 * low:
        print(f"WARNING: the alternating pairs disagree ({low:.2f}x vs {high:.2f}x): the machine's speed changed "
              "during the run (other load?); rerun before trusting the ratios")
    result["pairs_agree"] = high <= 1.25 * low
    print(f"ratios: gateway / transformers static batch {result['ratio_vs_static_batch']:.2f}x "
          f"(per alternating pair: {', '.join(f'{r:.2f}x' for r in result['ratio_per_pair'])}) "
          f"(target >= {TARGET_VS_STATIC_BATCH}x; {result['ratio_vs_static_batch_generated']:.2f}x against its "
          f"padded token count); gateway / one at a time {result['ratio_vs_one_at_a_time']:.2f}x; "
          f"prefix-hit TTFT / miss {prefix_ratio:.3f} (target <= {TARGET_PREFIX_TTFT_RATIO})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
