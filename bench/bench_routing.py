"""Routing benchmark: two model workers behind one gateway, cache-aware against round-robin and least-load.

Starts the tokenizer, two workers (one thread each) and a gateway per policy, all fresh, and
replays the same trace on each: a few shared system prompts (512 tokens by default), each
followed by a short user turn, arriving as a Poisson process. Each worker's KV cache holds
only some of the system prompts, so where a request lands decides whether its prefix is
cached. Reported per policy: prefix-cache hit rate (over both workers, from their metrics),
TTFT p50/p99 and output tokens/s. The last line printed is one JSON object.

    python -m bench.bench_routing            # Qwen3-0.6B shape, random weights (slow on CPU)
    python -m bench.bench_routing --quick    # a smoke check on the tiny preset
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
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from demo.checkpoint import build_demo_checkpoint  # noqa: E402
from services.tokenizer.core import TokenizerCore  # noqa: E402
from tests.integration.stack import Service, free_port, wait_serving  # noqa: E402
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402

POLICIES = ("cache-aware", "round-robin", "least-load")
TARGET_HIT_RATE_RATIO = 1.8   # cache-aware hit rate over round-robin's, at least
TARGET_TTFT_P50_RATIO = 0.6   # cache-aware TTFT p50 over round-robin's, at most


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_routing", description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=pathlib.Path, default=None,
                        help="Qwen3 checkpoint directory (default: a random one of --preset's shape, written once)")
    parser.add_argument("--preset", default="qwen3-0.6b", help="demo checkpoint shape when --checkpoint is not given")
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--system-prompt-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--rate", type=float, default=1.0, help="mean arrivals per second (Poisson)")
    parser.add_argument("--cached-prompts-per-worker", type=float, default=5.0,
                        help="KV cache per worker, in system prompts (all of them must not fit in one)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.num_requests, args.rate = "tiny", 24, 8.0
        args.system_prompts, args.system_prompt_tokens, args.cached_prompts_per_worker = 4, 128, 2.5
    return args


def make_trace(args, tokenizer: TokenizerCore) -> list[tuple[float, str]]:
    """(arrival second, prompt text): a random system prompt, then a user turn of its own."""
    rng = random.Random(args.seed)
    words = sorted(" " + t[1:] for t in tokenizer.tokenizer.get_vocab() if re.fullmatch(r"Ġ[a-z]{3,9}", t))
    systems = ["".join(rng.choice(words) for _ in range(args.system_prompt_tokens)) for _ in range(args.system_prompts)]
    trace, now = [], 0.0
    for _ in range(args.num_requests):
        now += rng.expovariate(args.rate)
        user = "".join(rng.choice(words) for _ in range(args.user_tokens))
        trace.append((now, rng.choice(systems) + "\n\nUser:" + user))
    return trace


def kv_block_bytes(checkpoint: pathlib.Path, block_size: int) -> int:
    config = json.loads((checkpoint / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * block_size * 2  # bf16


def start_fleet(args, checkpoint: pathlib.Path, policy: str, log_dir: str) -> tuple[list[Service], list[int]]:
    blocks = int(args.cached_prompts_per_worker * args.system_prompt_tokens / args.block_size)
    blocks += 4 * -(-(args.user_tokens + args.output_tokens + 16) // args.block_size)  # room for a few turns
    common = ["--grace-period", "1"]
    tokenizer = Service("tokenizer", ["services.tokenizer", "--model", str(checkpoint), *common], free_port(),
                        f"{log_dir}/{policy}-tokenizer.log")
    metrics_ports = [free_port(), free_port()]
    workers = [Service(f"worker{i}", ["services.model_worker", "--model", str(checkpoint), "--dtype", "bfloat16",
                                      "--block-size", str(args.block_size),
                                      "--kv-cache-bytes", str(blocks * kv_block_bytes(checkpoint, args.block_size)),
                                      "--metrics-port", str(metrics_ports[i]), *common],
                       free_port(), f"{log_dir}/{policy}-worker{i}.log") for i in range(2)]
    gateway = Service("gateway", ["gateway", "--tokenizer-addr", tokenizer.address, "--worker-addr",
                                  ",".join(w.address for w in workers), "--routing", policy, *common],
                      free_port(), f"{log_dir}/{policy}-gateway.log")
    services = [tokenizer, *workers, gateway]
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per worker: two workers share this machine's cores
    for service in services:
        service.start()
    for service in services:
        wait_serving(service.address, timeout=600)
    return services, metrics_ports


def prefix_counters(metrics_port: int) -> tuple[float, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    values = {}
    for name in ("vllm_v0_worker_prefix_cache_queried_tokens_total", "vllm_v0_worker_prefix_cache_hit_tokens_total"):
        values[name] = float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
    return values["vllm_v0_worker_prefix_cache_queried_tokens_total"], values["vllm_v0_worker_prefix_cache_hit_tokens_total"]


async def replay(address: str, trace: list[tuple[float, str]], output_tokens: int) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        async def one(at: float, prompt: str, start: float) -> tuple[float, int]:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            sent, ttft, tokens = time.perf_counter(), None, 0
            async for reply in stub.Generate(gateway_pb2.GenerateRequest(
                    prompt=prompt, max_tokens=output_tokens, ignore_eos=True, temperature=0), timeout=600):
                ttft = ttft if ttft is not None else time.perf_counter() - sent
                tokens += len(reply.token_ids)
            return ttft, tokens

        start = time.perf_counter()
        results = await asyncio.gather(*(one(at, prompt, start) for at, prompt in trace))
        wall = time.perf_counter() - start
    ttfts = sorted(r[0] for r in results)
    return {"ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "output_tok_s": sum(r[1] for r in results) / wall, "wall_s": wall}


def main(argv=None) -> None:
    args = parse_args(argv)
    checkpoint = args.checkpoint or ROOT / ".cache" / f"routing-{args.preset}"
    if not (checkpoint / "model.safetensors").exists():
        print(f"writing a random {args.preset} checkpoint to {checkpoint}", flush=True)
        build_demo_checkpoint(checkpoint, args.preset, "bfloat16", seed=args.seed)
    trace = make_trace(args, TokenizerCore.from_dir(checkpoint))
    print(f"{len(trace)} requests over {trace[-1][0]:.0f} s: {args.system_prompts} system prompts of "
          f"{args.system_prompt_tokens} tokens, user turns of {args.user_tokens}, {args.output_tokens} output tokens; "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} CPUs", flush=True)
    log_dir = tempfile.mkdtemp(prefix="bench-routing-")
    results = {}
    for policy in args.policies.split(","):
        services, metrics_ports = start_fleet(args, checkpoint, policy, log_dir)
        try:
            figures = asyncio.run(replay(services[-1].address, trace, args.output_tokens))
            counters = [prefix_counters(p) for p in metrics_ports]
        finally:
            for service in reversed(services):
                service.stop()
        queried, hits = sum(c[0] for c in counters), sum(c[1] for c in counters)
        figures["hit_rate"] = hits / queried if queried else 0.0
        figures["hit_rate_per_worker"] = [c[1] / c[0] if c[0] else 0.0 for c in counters]
        results[policy] = figures
        print(f"{policy:>12}: hit rate {figures['hit_rate']:.2f}, TTFT p50 {figures['ttft_p50_s'] * 1e3:.0f} ms, "
              f"p99 {figures['ttft_p99_s'] * 1e3:.0f} ms, {figures['output_tok_s']:.1f} output tok/s", flush=True)
    summary = {"results": results, "logs": log_dir}
    if "cache-aware" in results and "round-robin" in results:
        ca, rr = results["cache-aware"], results["round-robin"]
        summary["hit_rate_ratio"] = ca["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else None
        summary["ttft_p50_ratio"] = ca["ttft_p50_s"] / rr["ttft_p50_s"]
        summary["targets"] = {"hit_rate_ratio_min": TARGET_HIT_RATE_RATIO, "ttft_p50_ratio_max": TARGET_TTFT_P50_RATIO}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
