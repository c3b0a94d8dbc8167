"""Adversarial harness: hostile requests beside ordinary streams; none may restart a core, stall a loop or cut a neighbour.

    python -m bench.adversarial --start                    # tiny demo checkpoint, a stack of its own, 60 s
    python -m bench.adversarial --start --seconds 600      # the long form
    python -m bench.adversarial --gateway-addr 127.0.0.1:50051 --http-url http://127.0.0.1:8000 \\
        --metrics gateway=127.0.0.1:9101 --metrics tokenizer=127.0.0.1:9102 --metrics worker=127.0.0.1:9103

Attackers send, round after round, what a hostile client or a confused model produces (attacks.py
beside this file lists them): JSON schemas nested deep or spread wide, pathological regular
expressions and grammars, tools with huge or malformed schemas, prompts at and past the limits,
requests invalid on their face, and outputs steered by `logit_bias` or a forced grammar into
whitespace runs, unterminated tool calls, malformed call JSON and thinking tags. Neighbours stream
ordinary greedy requests at the same time; each must carry exactly the tokens it carries alone.

It checks, and exits 1 unless all hold:
- every request ends with a clear status: no INTERNAL, UNKNOWN, UNAVAILABLE or deadline (HTTP: no 5xx);
- no engine core restarts (the worker's restart counter, and with --start its core's pid);
- no event loop stalls over 250 ms (each service's loop-lag histogram, read before and after);
- every neighbour stream finishes whole.
The last line printed is one JSON object with every count.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.attacks import ATTACKS, Attack, Served
from bench.soak import check_loopback
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from vllm_v0.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc

# A clear answer to a bad request; anything else is a failure of the service, not of the request.
GOOD_GRPC = {"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "OUT_OF_RANGE", "NOT_FOUND", "FAILED_PRECONDITION"}
GOOD_HTTP = {200, 400, 404, 413, 422, 429}
STALL_S = 0.25
LAG_BOUNDS_S = (0.05, 0.1)  # the loop-lag histogram's buckets below STALL_S, reported without failing
RESTARTS = "vllm_v0_worker_engine_core_restarts"
LOOP_LAG = "vllm_v0_event_loop_lag_seconds"
NEIGHBOUR_PROMPTS = ["The capital of France is", "你好，世界！今天天气", "def fibonacci(n):", "Emoji time 🎉🚀 and"]
NEIGHBOUR_TOKENS = 48


@dataclass
class Tally:
    by_attack: dict[str, Counter] = field(default_factory=dict)  # attack -> status -> count
    bad: Counter = field(default_factory=Counter)                # "attack status" -> count
    bad_examples: dict[str, str] = field(default_factory=dict)
    examples: dict[str, dict[str, str]] = field(default_factory=dict)  # attack -> status -> its first answer
    neighbours: Counter = field(default_factory=Counter)         # whole / broken / failed
    first_broken: str = ""

    def record(self, attack: str, status: str, good: bool, detail: str = "") -> None:
        self.by_attack.setdefault(attack, Counter())[status] += 1
        self.examples.setdefault(attack, {}).setdefault(status, detail[:160])
        if not good:
            self.bad[f"{attack} {status}"] += 1
            self.bad_examples.setdefault(attack, f"{status}: {detail}"[:400])


def scrape(address: str) -> dict[str, float]:
    """Every sample of a /metrics page, keyed by its name and labels."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()))
            samples[key] = s.value
    return samples


def stalls_over(samples: dict[str, float], seconds: float) -> float | None:
    """Loop-lag observations above `seconds`, from the histogram's count and the bucket at that bound."""
    count = samples.get(f"{LOOP_LAG}_count")
    under = samples.get(f"{LOOP_LAG}_bucket,le={seconds}")
    return None if count is None or under is None else count - under


async def grpc_attack(stub, request: gateway_pb2.GenerateRequest, timeout: float) -> tuple[str, str]:
    try:
        text = ""
        async for message in stub.Generate(request, timeout=timeout):
            text += message.text
        return "OK", text[-200:]
    except grpc.aio.AioRpcError as e:
        return e.code().name, e.details() or ""


async def http_attack(client: httpx.AsyncClient, path: str, body: dict | bytes, timeout: float) -> tuple[int, str]:
    try:
        if isinstance(body, bytes):
            reply = await client.post(path, content=body, headers={"content-type": "application/json"},
                                      timeout=timeout)
            return reply.status_code, reply.text[:300]
        if body.get("stream"):
            async with client.stream("POST", path, json=body, timeout=timeout) as reply:
                text = "".join([chunk async for chunk in reply.aiter_text()])
                # An error after the first event arrives in the stream, not in the status.
                status = 500 if '"error"' in text and reply.status_code == 200 else reply.status_code
                return status, text[-300:]
        reply = await client.post(path, json=body, timeout=timeout)
        return reply.status_code, reply.text[:300]
    except httpx.TimeoutException as e:
        return 504, f"client timeout: {e!r}"
    except httpx.HTTPError as e:
        return 599, f"transport: {e!r}"


async def run_attack(attack: Attack, rng: random.Random, served: Served, stub, client, timeout: float,
                     tally: Tally) -> None:
    request = attack.build(rng, served)
    if isinstance(request, dict) and request.get("model") == "":
        request["model"] = served.model
    if attack.http_path is None:
        status, detail = await grpc_attack(stub, request, timeout)
        tally.record(attack.name, status, status in GOOD_GRPC, detail)
    else:
        code, detail = await http_attack(client, attack.http_path, request, timeout)
        tally.record(attack.name, str(code), code in GOOD_HTTP, detail)


def neighbour_request(i: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=NEIGHBOUR_PROMPTS[i % len(NEIGHBOUR_PROMPTS)], temperature=0,
                                       max_tokens=NEIGHBOUR_TOKENS, ignore_eos=True)


async def neighbour_stream(stub, request, timeout: float) -> tuple[list[int], str, str]:
    ids, text, finish = [], "", ""
    async for message in stub.Generate(request, timeout=timeout):
        ids.extend(message.token_ids)
        text += message.text
        finish = message.finish_reason or finish
    return ids, text, finish


async def served_of(channel, gateway) -> Served:
    """The served model's name, and the ids the steering attacks bias, from the services rather than assumed."""
    stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)

    async def one(text: str) -> int:
        ids = (await stub.Encode(tokenizer_pb2.EncodeRequest(text=text), timeout=30)).token_ids
        if len(ids) != 1:
            raise SystemExit(f"the served vocabulary does not hold {text!r} as one token: {list(ids)}")
        return ids[0]

    model = (await gateway.GetInfo(gateway_pb2.GetInfoRequest(), timeout=30)).model
    return Served(model=model, space=await one(" "), tool_call=await one("<tool_call>"), think=await one("<think>"),
                 think_end=await one("</think>"), bracket=await one("["))


async def harness(addresses: dict[str, str], http_url: str, metrics: dict[str, str], seconds: float,
                  attackers: int, neighbours: int, timeout: float, seed: int, core_pid=None,
                  attacks: list[Attack] = ATTACKS) -> dict:
    gateway_channel = grpc.aio.insecure_channel(addresses["gateway"], options=[
        ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
    tokenizer_channel = grpc.aio.insecure_channel(addresses["tokenizer"])
    stub = gateway_pb2_grpc.GatewayServiceStub(gateway_channel)
    served = await served_of(tokenizer_channel, stub)
    tally = Tally()
    # Each neighbour's tokens alone first: the reference every later stream of it must match.
    expected = {}
    for i in range(len(NEIGHBOUR_PROMPTS)):
        expected[i] = await neighbour_stream(stub, neighbour_request(i), timeout)
    before = {name: scrape(addr) for name, addr in metrics.items()}
    pid_before = core_pid() if core_pid else None
    start = time.monotonic()
    stop_at = start + seconds

    turns = itertools.count()  # shared: every kind in turn, so a short run still sends each

    async def attacker(n: int) -> None:
        rng = random.Random(seed * 1000 + n)  # the seed varies each request's shape
        async with httpx.AsyncClient(base_url=http_url) as client:
            while time.monotonic() < stop_at:
                await run_attack(attacks[next(turns) % len(attacks)], rng, served, stub, client, timeout, tally)

    async def neighbour(n: int) -> None:
        i = n
        while time.monotonic() < stop_at:
            key = i % len(NEIGHBOUR_PROMPTS)
            try:
                got = await neighbour_stream(stub, neighbour_request(key), timeout)
            except grpc.aio.AioRpcError as e:
                tally.neighbours["failed"] += 1
                tally.first_broken = tally.first_broken or f"neighbour {key}: {e.code().name} {e.details()}"
            else:
                whole = got == expected[key] and len(got[0]) == NEIGHBOUR_TOKENS
                tally.neighbours["whole" if whole else "broken"] += 1
                if not whole and not tally.first_broken:
                    tally.first_broken = (f"neighbour {key}: {len(got[0])} tokens ({got[2]!r}), "
                                          f"{len(expected[key][0])} alone")
            i += 1

    await asyncio.gather(*(attacker(n) for n in range(attackers)), *(neighbour(n) for n in range(neighbours)))
    elapsed = time.monotonic() - start
    after = {name: scrape(addr) for name, addr in metrics.items()}
    health = {}
    for name, channel in (("gateway", gateway_channel), ("tokenizer", tokenizer_channel)):
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            health[name] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as e:
            health[name] = e.code().name
    await gateway_channel.close()
    await tokenizer_channel.close()

    stalls, missing = {}, []
    lags = {bound: {} for bound in LAG_BOUNDS_S}  # below the failing bound: how close the run came to it
    for name in metrics:
        if stalls_over(after[name], STALL_S) is None:
            missing.append(f"{name}: {LOOP_LAG}")
            continue
        for bound, counts in [(STALL_S, stalls), *lags.items()]:
            counts[name] = stalls_over(after[name], bound) - (stalls_over(before[name], bound) or 0)
    restarts = None
    if "worker" in metrics:
        if f"{RESTARTS}_total" in after["worker"]:
            restarts = after["worker"][f"{RESTARTS}_total"] - before["worker"].get(f"{RESTARTS}_total", 0)
        else:
            missing.append(f"worker: {RESTARTS}_total")
    if core_pid is not None and core_pid() != pid_before:
        restarts = max(restarts or 0, 1)
    statuses = Counter()
    for counts in tally.by_attack.values():
        statuses.update(counts)
    return {
        "seconds": round(elapsed, 1), "requests": sum(statuses.values()), "by_status": dict(statuses),
        "by_attack": {name: dict(counts) for name, counts in sorted(tally.by_attack.items())},
        "unclear_statuses": sum(tally.bad.values()), "internal": statuses["INTERNAL"] + statuses["500"],
        "bad": dict(tally.bad), "bad_examples": tally.bad_examples, "examples": tally.examples,
        "core_restarts": restarts, "loop_stalls_over_250ms": stalls, "metrics_missing": missing,
        "loop_lags_over": {f"{round(bound * 1000)}ms": counts for bound, counts in lags.items()},
        "neighbours": dict(tally.neighbours), "first_broken_neighbour": tally.first_broken, "health_after": health,
    }


def passed(result: dict) -> bool:
    return (result["unclear_statuses"] == 0 and not result.get("exited") and result["core_restarts"] == 0 and not result["metrics_missing"]
            and not any(result["loop_stalls_over_250ms"].values())
            and result["neighbours"].get("whole", 0) > 0 and set(result["neighbours"]) == {"whole"}
            and all(s == "SERVING" for s in result["health_after"].values()))


def start_stack(log_dir: str):
    """The tiny demo checkpoint and the three services, each with its /metrics and the gateway's HTTP port."""
    import subprocess

    from tests.integration.stack import free_port, make_stack

    checkpoint = f"{log_dir}/demo-model"
    subprocess.run([sys.executable, "-m", "demo.checkpoint", "--out", checkpoint, "--preset", "tiny"], check=True,
                   stdout=subprocess.DEVNULL, timeout=600)
    ports = {name: free_port() for name in ("tokenizer", "worker", "gateway", "http")}
    # A queue long enough for every attacker's 256-prompt request at once: a full queue is backpressure,
    # answered RESOURCE_EXHAUSTED, and would fail the neighbours for a reason that is no fault.
    worker_flags = ["--max-waiting", "4096", "--metrics-port", str(ports["worker"])]
    stack = make_stack(checkpoint, log_dir, worker_flags=worker_flags,
                       tokenizer_flags=["--metrics-port", str(ports["tokenizer"])],
                       gateway_flags=["--metrics-port", str(ports["gateway"]), "--http-port", str(ports["http"])])
    stack.start(timeout=300)
    stack.metrics = {name: f"127.0.0.1:{ports[name]}" for name in ("tokenizer", "worker", "gateway")}
    stack.http_url = f"http://127.0.0.1:{ports['http']}"
    return stack


def run(args) -> dict:
    attacks = [a for a in ATTACKS if not args.attacks or a.name in args.attacks.split(",")]
    with tempfile.TemporaryDirectory(prefix="adversarial-") as work:
        work = args.log_dir or work
        stack, core_pid = None, None
        if args.start:
            from tests.integration.stack import child_pids

            stack = start_stack(work)
            addresses = {s.name: s.address for s in stack.services}
            http_url, metrics = stack.http_url, stack.metrics
            core_pid = lambda: tuple(child_pids(stack.worker.process.pid))  # noqa: E731
        else:
            addresses = {"gateway": args.gateway_addr, "tokenizer": args.tokenizer_addr}
            http_url = args.http_url
            metrics = dict(item.split("=", 1) for item in args.metrics)
            for addr in [*addresses.values(), *metrics.values(), http_url.split("//", 1)[-1]]:
                check_loopback(addr)
        try:
            result = asyncio.run(harness(addresses, http_url, metrics, args.seconds, args.attackers, args.neighbours,
                                         args.timeout, args.seed, core_pid, attacks))
            if stack is not None:
                result["exited"] = {s.name: s.process.returncode for s in stack.services if s.process.poll() is not None}
                result["stalls_logged"] = {s.name: entries for s in stack.services
                                           if (entries := stall_entries(s.log()))}
        finally:
            if stack is not None:
                stack.stop()
    return result


def stall_entries(log: str, keep: int = 3) -> list[str]:
    """A service log's last `keep` stall warnings, each with the stack the loop thread was at."""
    entries, current = [], None
    for line in log.splitlines():
        if line[:2] == "20" and line[4:5] == "-":  # a record's first line starts with its timestamp
            current = None
            if "event loop stalled" in line:
                current = [line]
                entries.append(current)
        elif current is not None:
            current.append(line)
    return ["\n".join(entry)[:2000] for entry in entries[-keep:]]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.adversarial", description=__doc__.split("\n\n")[0])
    parser.add_argument("--start", action="store_true", help="start a stack of its own on the tiny demo checkpoint")
    parser.add_argument("--gateway-addr", default="127.0.0.1:50051", help="the gateway's gRPC host:port")
    parser.add_argument("--tokenizer-addr", default="127.0.0.1:50052", help="the tokenizer's gRPC host:port")
    parser.add_argument("--http-url", default="http://127.0.0.1:8000", help="the gateway's HTTP API")
    parser.add_argument("--metrics", action="append", default=[], metavar="SERVICE=HOST:PORT",
                        help="a service's /metrics (gateway, tokenizer, worker); give all three")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to attack (default: 60)")
    parser.add_argument("--attackers", type=int, default=4, help="hostile requests in flight (default: 4)")
    parser.add_argument("--neighbours", type=int, default=2, help="ordinary streams in flight (default: 2)")
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline of each request, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attacks", default="", help="comma-separated attack names to send (default: all; "
                        "bench/attacks.py lists them)")
    parser.add_argument("--log-dir", help="with --start: keep the services' logs and checkpoint here")
    args = parser.parse_args(argv)
    unknown = set(filter(None, args.attacks.split(","))) - {a.name for a in ATTACKS}
    if unknown:
        parser.error(f"no such attack: {', '.join(sorted(unknown))}")
    if args.seconds <= 0 or args.attackers < 1 or args.neighbours < 1:
        parser.error("--seconds must be > 0, --attackers and --neighbours >= 1")
    if not args.start and {m.split("=", 1)[0] for m in args.metrics} != {"gateway", "tokenizer", "worker"}:
        parser.error("without --start, give --metrics for gateway, tokenizer and worker")
    return args


def main(argv=None) -> None:
    result = run(parse_args(argv))
    print(f"{result['requests']} hostile requests in {result['seconds']} s; by status: {result['by_status']}")
    print(f"unclear statuses: {result['unclear_statuses']} (INTERNAL or 500: {result['internal']}); "
          f"core restarts: {result['core_restarts']}; loop stalls over 250 ms: {result['loop_stalls_over_250ms']}")
    print(f"neighbour streams: {result['neighbours']}; health after: {result['health_after']}")
    print(json.dumps(result, ensure_ascii=False))
    sys.exit(0 if passed(result) else 1)


if __name__ == "__main__":
    main()
