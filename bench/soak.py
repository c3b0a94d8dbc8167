"""Soak test: many concurrent streams for minutes, each checked token by token against its request's known output.

    python -m bench.soak --start                     # builds the tiny demo checkpoint, starts its own stack
    python -m bench.soak --start --streams 32 --max-tokens 512 --minutes 5 --cancel-rate 0.1
    python -m bench.soak --addr 127.0.0.1:50051 --worker-addr 127.0.0.1:50053 --streams 16 --minutes 5

Requests alternate greedy and seeded sampling (a seeded request's tokens depend only on its seed,
never on its batch). Each request's expected tokens and text are computed once at the start by
running it alone; every later stream of it must deliver exactly those tokens, once each and in
order, and exactly that text. A stream the soak cancels part-way must have delivered a prefix of
them. At the end the worker's KV pool must be entirely free. The last line printed is one JSON
object with every count.
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc

from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

# A mix of scripts, so multi-byte characters split across tokens are part of what is checked.
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a village by the sea,",
    "你好，世界！今天天气",
    "日本語のテキスト 😀 mixed with English",
    "Emoji time 🎉🚀 and 👩‍👩‍👧",
    "def fibonacci(n):",
    "Список покупок: хлеб, молоко,",
    "The quick brown fox",
]


@dataclass(frozen=True)
class Variant:
    """One request the soak repeats: a prompt, greedy or seeded sampling, and its length."""
    prompt: str
    max_tokens: int
    seed: int | None = None  # None: greedy

    def request(self) -> gateway_pb2.GenerateRequest:
        req = gateway_pb2.GenerateRequest(prompt=self.prompt, max_tokens=self.max_tokens, ignore_eos=True)
        if self.seed is None:
            req.temperature = 0
        else:
            req.temperature, req.top_p, req.seed = 0.8, 0.95, self.seed
        return req


@dataclass
class Expected:
    token_ids: list[int]
    text: str


@dataclass
class Tally:
    done: int = 0          # streams that ended OK with a finish reason
    correct: int = 0       # ... and carried exactly the expected tokens and text
    lost: int = 0          # streams missing expected tokens
    duplicated: int = 0    # streams carrying a token more often than expected
    reordered: int = 0     # streams with the right tokens in the wrong order
    mismatched: int = 0    # streams whose text differs from the expected text
    cut: int = 0           # streams that ended OK without a finish reason
    cancelled: int = 0     # streams the soak cancelled part-way
    bad_prefix: int = 0    # ... whose tokens or text so far were not a prefix of the expected ones
    tokens: int = 0        # tokens received by streams that ended OK
    errors: Counter = field(default_factory=Counter)  # status code name -> count
    ttft_s: list[float] = field(default_factory=list)
    per_token_s: list[float] = field(default_factory=list)
    first_bad: str = ""    # one example, for diagnosis


async def run_stream(stub, variant: Variant, timeout: float, cancel_after: int | None = None):
    """One stream: (token ids, text, finish reason, ttft, inter-token gaps); cancelled after `cancel_after` tokens."""
    start = time.perf_counter()
    ids: list[int] = []
    text, finish, ttft, gaps, last = "", 0, None, [], None
    call = stub.Generate(variant.request(), timeout=timeout)
    async for message in call:
        now = time.perf_counter()
        if ttft is None:
            ttft = now - start
        elif message.token_ids:
            gaps.append((now - last) / len(message.token_ids))
        last = now
        ids.extend(message.token_ids)
        text += message.text
        finish = message.finish_reason or finish
        if cancel_after is not None and len(ids) >= cancel_after and not finish:
            call.cancel()
            break
    return ids, text, finish, ttft, gaps


def classify(ids: list[int], text: str, want: Expected, tally: Tally, label: str) -> None:
    got, expected = Counter(ids), Counter(want.token_ids)
    problems = []
    if expected - got:
        tally.lost += 1
        problems.append("lost")
    if got - expected:
        tally.duplicated += 1
        problems.append("duplicated")
    if got == expected and ids != want.token_ids:
        tally.reordered += 1
        problems.append("reordered")
    if text != want.text:
        tally.mismatched += 1
        problems.append("mismatched")
    if not problems:
        tally.correct += 1
    elif not tally.first_bad:
        first_diff = next((i for i, (a, b) in enumerate(zip(ids, want.token_ids)) if a != b),
                          min(len(ids), len(want.token_ids)))
        tally.first_bad = (f"{label}: {', '.join(problems)}; {len(ids)} tokens vs {len(want.token_ids)} expected, "
                           f"first difference at token {first_diff}")


def make_variants(rng: random.Random, max_tokens: int | None) -> list[Variant]:
    """Every prompt once: even ones greedy, odd ones seeded. Without a fixed length, lengths of 24 to 96
    drawn from the seed, so streams start and end out of step with each other."""
    return [Variant(prompt, max_tokens or rng.randrange(24, 97), None if i % 2 == 0 else 1000 + i)
            for i, prompt in enumerate(PROMPTS)]


async def expected_outputs(stub, variants: list[Variant], timeout: float) -> list[Expected]:
    """Each request run alone, one after another: the reference every concurrent stream must match."""
    wants = []
    for variant in variants:
        ids, text, finish, _, _ = await run_stream(stub, variant, timeout)
        if not finish:
            raise SystemExit(f"the reference run of {variant} ended without a finish reason")
        wants.append(Expected(ids, text))
    return wants


async def worker_loop(stub, wants: list[Expected], variants: list[Variant], stop_at: float, timeout: float,
                      cancel_rate: float, rng: random.Random, tally: Tally) -> None:
    while time.monotonic() < stop_at:
        i = rng.randrange(len(variants))
        cancel_after = rng.randrange(1, variants[i].max_tokens) if rng.random() < cancel_rate else None
        try:
            ids, text, finish, ttft, gaps = await run_stream(stub, variants[i], timeout, cancel_after)
        except grpc.aio.AioRpcError as e:
            tally.errors[e.code().name] += 1
            await asyncio.sleep(0.1)  # a refused or failed call must not turn into a tight retry loop
            continue
        if cancel_after is not None and not finish:
            tally.cancelled += 1
            # Text may lag its tokens (a character split across tokens, held back), never run ahead.
            if ids != wants[i].token_ids[:len(ids)] or not wants[i].text.startswith(text):
                tally.bad_prefix += 1
                tally.first_bad = tally.first_bad or f"variant {i}: cancelled stream is not a prefix"
            continue
        if not finish:
            tally.cut += 1
            continue
        tally.done += 1
        tally.tokens += len(ids)
        if ttft is not None:
            tally.ttft_s.append(ttft)
        tally.per_token_s.extend(gaps)
        classify(ids, text, wants[i], tally, f"variant {i}")


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    return {"p50_ms": round(at(0.50) * 1e3, 2), "p90_ms": round(at(0.90) * 1e3, 2),
            "p99_ms": round(at(0.99) * 1e3, 2), "max_ms": round(ordered[-1] * 1e3, 2)}


async def worker_pool(worker_addr: str | None, wait_s: float = 30.0) -> dict | None:
    """The worker's counters once it is idle (cancelled sequences leave at the next step), or as they stand after `wait_s`."""
    if worker_addr is None:
        return None
    async with grpc.aio.insecure_channel(worker_addr) as channel:
        stub = worker_pb2_grpc.ModelWorkerServiceStub(channel)
        deadline = time.monotonic() + wait_s
        while True:
            info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
            idle = info.running == 0 and info.waiting == 0 and info.kv_blocks_used == 0
            if idle or time.monotonic() > deadline:
                return {"running": info.running, "waiting": info.waiting, "kv_blocks_used": info.kv_blocks_used,
                        "kv_blocks_free": info.kv_blocks_free, "tokens_after_cancel": info.tokens_after_cancel}
            await asyncio.sleep(0.2)


async def soak(addr: str, streams: int, minutes: float, timeout: float, seed: int, max_tokens: int | None = None,
               cancel_rate: float = 0.0, worker_addr: str | None = None) -> dict:
    variants = make_variants(random.Random(seed), max_tokens)
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        wants = await expected_outputs(stub, variants, timeout)
        print(f"expected outputs: {len(wants)} requests, {sum(len(w.token_ids) for w in wants)} tokens in all",
              file=sys.stderr)
        tally = Tally()
        start = time.monotonic()
        stop_at = start + minutes * 60
        await asyncio.gather(*(worker_loop(stub, wants, variants, stop_at, timeout, cancel_rate,
                                           random.Random(seed + 1 + n), tally) for n in range(streams)))
        elapsed = time.monotonic() - start
    tokens = tally.tokens
    pool = await worker_pool(worker_addr)
    return {"streams": streams, "seconds": round(elapsed, 1), "requests_done": tally.done,
            "correct": tally.correct, "lost": tally.lost, "duplicated": tally.duplicated,
            "reordered": tally.reordered, "mismatched": tally.mismatched, "cut": tally.cut,
            "cancelled": tally.cancelled, "bad_prefix": tally.bad_prefix, "worker_at_end": pool,
            "errors": dict(tally.errors), "tokens": tokens, "tokens_per_s": round(tokens / elapsed, 1),
            "ttft": percentiles(tally.ttft_s), "per_token": percentiles(tally.per_token_s),
            "first_bad": tally.first_bad}


def check_loopback(addr: str) -> None:
    host = addr.rsplit(":", 1)[0].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(f"--addr {addr}: this soak test only talks to a gateway on this machine (loopback)")


def build_demo_checkpoint(work_dir: str) -> str:
    """Write the tiny demo checkpoint (random weights, the real vocabulary) under `work_dir`; its path."""
    import subprocess

    checkpoint = f"{work_dir}/demo-model"
    subprocess.run([sys.executable, "-m", "demo.checkpoint", "--out", checkpoint, "--preset", "tiny"], check=True,
                   stdout=subprocess.DEVNULL, timeout=600)
    return checkpoint


def start_stack(log_dir: str):
    """Build the tiny demo checkpoint and start the three services on free loopback ports."""
    from tests.integration.stack import make_stack

    checkpoint = build_demo_checkpoint(log_dir)
    stack = make_stack(checkpoint, log_dir, worker_flags=["--max-waiting", "1024"])
    try:
        stack.start(timeout=300)
    except BaseException:
        stack.stop()
        raise
    return stack


def print_summary(result: dict) -> None:
    print(f"{result['requests_done']} streams done in {result['seconds']} s with {result['streams']} concurrent, "
          f"{result['tokens']} tokens ({result['tokens_per_s']}/s)")
    print(f"correct {result['correct']}, lost {result['lost']}, duplicated {result['duplicated']}, "
          f"reordered {result['reordered']}, mismatched {result['mismatched']}, cut {result['cut']}")
    print(f"cancelled {result['cancelled']}, of which not a prefix of the expected output {result['bad_prefix']}")
    print(f"worker at the end: {result['worker_at_end'] or 'not asked (no --worker-addr)'}")
    print(f"errors by status: {result['errors'] or 'none'}")
    for name in ("ttft", "per_token"):
        p = result[name]
        if p:
            print(f"{name}: p50 {p['p50_ms']} ms, p90 {p['p90_ms']} ms, p99 {p['p99_ms']} ms, max {p['max_ms']} ms")
    if result["first_bad"]:
        print(f"first bad stream: {result['first_bad']}")
    print(json.dumps(result, ensure_ascii=False))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--addr", help="gateway host:port on this machine")
    target.add_argument("--start", action="store_true", help="start a stack of its own on the tiny demo checkpoint")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams (default: 8)")
    parser.add_argument("--minutes", type=float, default=2.0, help="how long to keep them going (default: 2)")
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline of each stream, seconds")
    parser.add_argument("--seed", type=int, default=0, help="seeds the request order, lengths and cancels")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="tokens per stream, eos ignored (default 0: 24 to 96, drawn from --seed)")
    parser.add_argument("--cancel-rate", type=float, default=0.0,
                        help="fraction of streams cancelled after a random number of tokens (default: 0)")
    parser.add_argument("--worker-addr", help="with --addr: the worker, whose KV pool must be free at the end")
    args = parser.parse_args(argv)
    if args.streams < 1 or args.minutes <= 0 or args.max_tokens < 0 or not 0 <= args.cancel_rate <= 1:
        parser.error("--streams must be >= 1, --minutes > 0, --max-tokens >= 0 and --cancel-rate in [0, 1]")

    with tempfile.TemporaryDirectory(prefix="soak-") as work:
        stack = None
        if args.start:
            stack = start_stack(work)
            addr, worker_addr = stack.gateway.address, stack.worker.address
            print(f"started a stack on the tiny demo checkpoint; gateway at {addr}", file=sys.stderr)
        else:
            check_loopback(args.addr)
            addr, worker_addr = args.addr, args.worker_addr
            if worker_addr:
                check_loopback(worker_addr)
        try:
            result = asyncio.run(soak(addr, args.streams, args.minutes, args.timeout, args.seed, args.max_tokens or None,
                                      args.cancel_rate, worker_addr))
        finally:
            if stack is not None:
                stack.stop()
    print_summary(result)
    bad = (result["lost"] + result["duplicated"] + result["reordered"] + result["mismatched"] + result["cut"]
           + result["bad_prefix"])
    pool = result["worker_at_end"]
    pool_busy = pool is not None and (pool["running"] or pool["waiting"] or pool["kv_blocks_used"])
    sys.exit(1 if bad or result["errors"] or pool_busy else 0)


if __name__ == "__main__":
    main()
