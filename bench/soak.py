"""Soak test: many concurrent greedy streams for minutes, each checked token by token against its prompt's known output.

    python -m bench.soak --start                     # builds the tiny demo checkpoint, starts its own stack
    python -m bench.soak --addr 127.0.0.1:50051 --streams 16 --minutes 5

Each prompt's expected tokens and text are computed once at the start by running it alone;
every later stream of that prompt must deliver exactly those tokens, once each and in order,
and exactly that text. The last line printed is one JSON object with every count.
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
    tokens: int = 0        # tokens received by streams that ended OK
    errors: Counter = field(default_factory=Counter)  # status code name -> count
    ttft_s: list[float] = field(default_factory=list)
    per_token_s: list[float] = field(default_factory=list)
    first_bad: str = ""    # one example, for diagnosis


def request(prompt: str, max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0)


async def run_stream(stub, prompt: str, max_tokens: int, timeout: float):
    """One stream: (token ids, text, finish reason, ttft, inter-token gaps)."""
    start = time.perf_counter()
    ids: list[int] = []
    text, finish, ttft, gaps, last = "", 0, None, [], None
    async for message in stub.Generate(request(prompt, max_tokens), timeout=timeout):
        now = time.perf_counter()
        if ttft is None:
            ttft = now - start
        elif message.token_ids:
            gaps.append((now - last) / len(message.token_ids))
        last = now
        ids.extend(message.token_ids)
        text += message.text
        finish = message.finish_reason or finish
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


async def expected_outputs(stub, max_tokens: list[int], timeout: float) -> list[Expected]:
    """Each prompt run alone, one after another: the reference every concurrent stream must match."""
    wants = []
    for prompt, tokens in zip(PROMPTS, max_tokens):
        ids, text, finish, _, _ = await run_stream(stub, prompt, tokens, timeout)
        if not finish:
            raise SystemExit(f"the reference run of {prompt!r} ended without a finish reason")
        wants.append(Expected(ids, text))
    return wants


async def worker_loop(stub, wants: list[Expected], max_tokens: list[int], stop_at: float, timeout: float,
                      rng: random.Random, tally: Tally) -> None:
    while time.monotonic() < stop_at:
        i = rng.randrange(len(PROMPTS))
        try:
            ids, text, finish, ttft, gaps = await run_stream(stub, PROMPTS[i], max_tokens[i], timeout)
        except grpc.aio.AioRpcError as e:
            tally.errors[e.code().name] += 1
            await asyncio.sleep(0.1)  # a refused or failed call must not turn into a tight retry loop
            continue
        if not finish:
            tally.cut += 1
            continue
        tally.done += 1
        tally.tokens += len(ids)
        if ttft is not None:
            tally.ttft_s.append(ttft)
        tally.per_token_s.extend(gaps)
        classify(ids, text, wants[i], tally, f"prompt {i}")


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    return {"p50_ms": round(at(0.50) * 1e3, 2), "p90_ms": round(at(0.90) * 1e3, 2),
            "p99_ms": round(at(0.99) * 1e3, 2), "max_ms": round(ordered[-1] * 1e3, 2)}


async def soak(addr: str, streams: int, minutes: float, timeout: float, seed: int) -> dict:
    rng = random.Random(seed)
    # Different lengths, so streams start and end out of step with each other.
    max_tokens = [rng.randrange(24, 97) for _ in PROMPTS]
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        wants = await expected_outputs(stub, max_tokens, timeout)
        print(f"expected outputs: {len(wants)} prompts, {sum(len(w.token_ids) for w in wants)} tokens in all",
              file=sys.stderr)
        tally = Tally()
        start = time.monotonic()
        stop_at = start + minutes * 60
        await asyncio.gather(*(worker_loop(stub, wants, max_tokens, stop_at, timeout, random.Random(seed + 1 + n),
                                           tally) for n in range(streams)))
        elapsed = time.monotonic() - start
    tokens = tally.tokens
    return {"streams": streams, "seconds": round(elapsed, 1), "requests_done": tally.done,
            "correct": tally.correct, "lost": tally.lost, "duplicated": tally.duplicated,
            "reordered": tally.reordered, "mismatched": tally.mismatched, "cut": tally.cut,
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


def start_stack(log_dir: str):
    """Build the tiny demo checkpoint and start the three services on free loopback ports."""
    import subprocess

    from tests.integration.stack import make_stack

    checkpoint = f"{log_dir}/demo-model"
    subprocess.run([sys.executable, "-m", "demo.checkpoint", "--out", checkpoint, "--preset", "tiny"], check=True,
                   stdout=subprocess.DEVNULL, timeout=600)
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
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompt order and lengths")
    args = parser.parse_args(argv)
    if args.streams < 1 or args.minutes <= 0:
        parser.error("--streams must be >= 1 and --minutes > 0")

    with tempfile.TemporaryDirectory(prefix="soak-") as work:
        stack = None
        if args.start:
            stack = start_stack(work)
            addr = stack.gateway.address
            print(f"started a stack on the tiny demo checkpoint; gateway at {addr}", file=sys.stderr)
        else:
            check_loopback(args.addr)
            addr = args.addr
        try:
            result = asyncio.run(soak(addr, args.streams, args.minutes, args.timeout, args.seed))
        finally:
            if stack is not None:
                stack.stop()
    print_summary(result)
    bad = result["lost"] + result["duplicated"] + result["reordered"] + result["mismatched"] + result["cut"]
    sys.exit(1 if bad or result["errors"] else 0)


if __name__ == "__main__":
    main()
