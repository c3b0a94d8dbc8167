"""Fuzz every method of the three services with generated requests; none may crash a service or answer UNKNOWN/INTERNAL.

    python -m bench.fuzz --start                         # builds the tiny demo checkpoint, starts its own stack
    python -m bench.fuzz --start --requests 10000 --seconds 60
    python -m bench.fuzz --gateway-addr 127.0.0.1:50051 --tokenizer-addr 127.0.0.1:50052 --worker-addr 127.0.0.1:50053

Each request sets a random subset of its message's fields, by reflection over the proto, to values
drawn from edge cases (empty, zero, negative, NaN, infinities, the largest integers, long and
multi-script text, special-token text, ids past the vocabulary) and ordinary ones. Any status is
fine except UNKNOWN and INTERNAL, which mean a bug; afterwards every service must still answer
SERVING. The last line printed is one JSON object with every count.

Requests are built without a service: `make_request(name, seed)` gives the one the fuzz would send
to a method of CALLS (`fill(message, rng)` for any message), and `fuzz(...)` runs against addresses.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import grpc
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.soak import check_loopback, start_stack
from rpcserver.status import status_from_number
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from vllm_v0.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

BAD_STATUSES = ("UNKNOWN", "INTERNAL")
TEXTS = ["", " ", "hello", "The capital of France is", "你好，世界", "😀🎉👩‍👩‍👧", "<|im_end|>", "<|endoftext|>",
         "<think>", "\x00", "\n\n", "system", "user", "assistant", "tool", "wizard", "a" * 300, "word " * 2000]
FLOATS = [0.0, -0.0, 1.0, -1.0, 0.5, 0.95, 2.0, -2.0, 2.5, 1e-30, 1e30, 3.4e38, math.nan, math.inf, -math.inf]
INTS = [0, 1, 2, 3, 7, 20, 21, 100, 511, 4095, 4096, 151643, 151645, 151935, 151936, 10**6, 2**31 - 1]


def random_value(field: FieldDescriptor, rng: random.Random):
    kind = field.type
    if kind == FieldDescriptor.TYPE_STRING:
        return rng.choice(TEXTS) if rng.random() < 0.8 else "".join(chr(rng.randrange(32, 0xD7FF))
                                                                     for _ in range(rng.randrange(1, 40)))
    if kind == FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return rng.choice(FLOATS) if rng.random() < 0.6 else rng.uniform(-3, 3)
    if kind == FieldDescriptor.TYPE_BYTES:
        return rng.randbytes(rng.choice([0, 1, 32, 300]))
    if kind == FieldDescriptor.TYPE_ENUM:
        numbers = [value.number for value in field.enum_type.values]
        # An open (proto3) enum keeps numbers it does not name, and a service must cope with them.
        return rng.choice(numbers) if field.enum_type.is_closed or rng.random() < 0.8 else rng.randrange(-5, 600)
    unsigned = kind in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED32,
                        FieldDescriptor.TYPE_FIXED64)
    top = {FieldDescriptor.TYPE_UINT32: 2**32 - 1, FieldDescriptor.TYPE_FIXED32: 2**32 - 1,
           FieldDescriptor.TYPE_UINT64: 2**64 - 1, FieldDescriptor.TYPE_FIXED64: 2**64 - 1,
           FieldDescriptor.TYPE_INT64: 2**63 - 1, FieldDescriptor.TYPE_SINT64: 2**63 - 1,
           FieldDescriptor.TYPE_SFIXED64: 2**63 - 1}.get(kind, 2**31 - 1)
    value = rng.choice(INTS + [top]) if rng.random() < 0.7 else rng.randrange(0, 600)
    return value if unsigned or rng.random() < 0.8 else -min(value, top)


def fill(message, rng: random.Random, depth: int = 0):
    """Set a random subset of `message`'s fields to random values; returns it."""
    for field in message.DESCRIPTOR.fields:
        if rng.random() < 0.5:
            continue
        repeated = field.is_repeated
        count = rng.choice([0, 1, 2, 3, 8, 40]) if repeated else 1
        if is_map(field):
            fill_map(getattr(message, field.name), field.message_type, count, rng, depth)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth < 2:
                for _ in range(count):
                    fill(getattr(message, field.name).add() if repeated else getattr(message, field.name), rng,
                         depth + 1)
        elif repeated:
            getattr(message, field.name).extend(random_value(field, rng) for _ in range(count))
        else:
            setattr(message, field.name, random_value(field, rng))
    return message


def is_map(field: FieldDescriptor) -> bool:
    # A map is a repeated message on the wire, but its Python container has no add(): it is filled by key.
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def fill_map(container, entry, count: int, rng: random.Random, depth: int) -> None:
    """Put `count` random entries (keys may repeat, so possibly fewer) into a map field's container."""
    key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
    for _ in range(count):
        key = random_value(key_field, rng)
        if value_field.type != FieldDescriptor.TYPE_MESSAGE:
            container[key] = random_value(value_field, rng)
        elif depth < 2:
            fill(container[key], rng, depth + 1)


def keep_short(message, rng: random.Random) -> None:
    """Most generations short, so the fuzz sends many requests rather than waits on a few long ones."""
    if rng.random() < 0.9:
        message.max_tokens = rng.randrange(1, 9)


def generate_request(cls) -> Callable[[random.Random], object]:
    """A Generate request of the gateway's or the worker's kind: random fields, most with a short max_tokens."""
    def make(rng):
        message = fill(cls(), rng)
        keep_short(message, rng)
        return message
    return make


def messages(make_one) -> Callable[[random.Random], list]:
    """A streaming call's requests: one to four random messages."""
    return lambda rng: [make_one(rng) for _ in range(rng.randrange(1, 5))]


def many_request(rng: random.Random):
    if rng.random() < 0.2:  # a cancel, of an id this call may or may not have started
        return worker_pb2.GenerateManyRequest(cancel=rng.choice(["", "a", "b", "\u00e9"]))
    return worker_pb2.GenerateManyRequest(start=generate_request(worker_pb2.GenerateRequest)(rng))


@dataclass(frozen=True)
class FuzzCall:
    """One method the fuzz drives."""

    name: str  # "service.Method": the service's key in the addresses, then the stub's method
    make: Callable[[random.Random], object]  # its request, or for a streaming call a list of them
    streaming: bool | str  # False: unary; True: server streaming; "lockstep", "bidi": see one_call


CALLS = (
    FuzzCall("gateway.Generate", generate_request(gateway_pb2.GenerateRequest), True),
    FuzzCall("gateway.GetInfo", lambda rng: gateway_pb2.GetInfoRequest(), False),
    FuzzCall("gateway.Embed", lambda rng: fill(gateway_pb2.EmbedRequest(), rng), False),
    FuzzCall("gateway.Score", lambda rng: fill(gateway_pb2.ScoreRequest(), rng), False),
    FuzzCall("tokenizer.Encode", lambda rng: fill(tokenizer_pb2.EncodeRequest(), rng), False),
    FuzzCall("tokenizer.Decode", lambda rng: fill(tokenizer_pb2.DecodeRequest(), rng), False),
    FuzzCall("tokenizer.DecodeIncremental", lambda rng: fill(tokenizer_pb2.DecodeIncrementalRequest(), rng), False),
    FuzzCall("tokenizer.GetInfo", lambda rng: tokenizer_pb2.GetInfoRequest(), False),
    FuzzCall("worker.Generate", generate_request(worker_pb2.GenerateRequest), True),
    FuzzCall("worker.GetInfo", lambda rng: worker_pb2.GetInfoRequest(), False),
    FuzzCall("worker.Embed", lambda rng: fill(worker_pb2.EmbedRequest(), rng), False),
    FuzzCall("worker.Score", lambda rng: fill(worker_pb2.ScoreRequest(), rng), False),
    # Random names and paths: a folder that is not there, or LoRA off (FAILED_PRECONDITION), never a crash.
    FuzzCall("worker.LoadAdapter", lambda rng: fill(worker_pb2.LoadAdapterRequest(), rng), False),
    FuzzCall("worker.UnloadAdapter", lambda rng: fill(worker_pb2.UnloadAdapterRequest(), rng), False),
    FuzzCall("tokenizer.DecodeStream", messages(lambda rng: fill(tokenizer_pb2.DecodeStreamRequest(), rng)),
             "lockstep"),
    FuzzCall("tokenizer.DecodeBatches", messages(lambda rng: fill(tokenizer_pb2.DecodeBatchRequest(), rng)),
             "lockstep"),
    FuzzCall("worker.GenerateMany", messages(many_request), "bidi"),
)

# Methods of the three services the fuzz leaves alone, and why.
LEFT_OUT = {"worker.WatchLoad": "its request has no fields, and its stream runs until the caller leaves"}


def make_request(name: str, seed: int):
    """The request (a list of them for a streaming call) that CALLS' `name` makes from `seed`; no service needed."""
    call = next((c for c in CALLS if c.name == name), None)
    if call is None:
        raise KeyError(f"no fuzzed method {name!r}; there are {[c.name for c in CALLS]}")
    return call.make(random.Random(seed))


def make_calls(channels: dict[str, grpc.aio.Channel]) -> list:
    """(name, stub method, request factory, streaming) for each of CALLS, over these channels."""
    stubs = {"gateway": gateway_pb2_grpc.GatewayServiceStub(channels["gateway"]),
             "tokenizer": tokenizer_pb2_grpc.TokenizerServiceStub(channels["tokenizer"]),
             "worker": worker_pb2_grpc.ModelWorkerServiceStub(channels["worker"])}
    calls = []
    for call in CALLS:
        service, method = call.name.split(".")
        calls.append((call.name, getattr(stubs[service], method), call.make, call.streaming))
    return calls


async def one_call(method, request, streaming: bool | str, timeout: float) -> str:
    try:
        if streaming == "lockstep":  # one reply per message: read it before the next, as real callers do
            # (a write racing the service's end of the call fails in the client's own core as INTERNAL,
            # hiding the status the service sent)
            call = method(timeout=timeout)
            for message in request:
                await call.write(message)
                # DecodeStream's `final` message is its last: the service ends the call after the reply.
                if await call.read() is grpc.aio.EOF or getattr(message, "final", False):
                    break
            else:
                await call.done_writing()
            return (await call.code()).name
        if streaming == "bidi":  # request: the messages to send; then read to the end
            call = method(timeout=timeout)
            for message in request:
                await call.write(message)
            await call.done_writing()
            async for response in call:
                for output in getattr(response, "outputs", ()):  # GenerateMany fails requests one by one
                    if output.error_code and (status := status_from_number(output.error_code).name) in BAD_STATUSES:
                        return status
        elif streaming:
            async for _ in method(request, timeout=timeout):
                pass
        else:
            await method(request, timeout=timeout)
        return "OK"
    except grpc.aio.AioRpcError as e:
        return e.code().name


async def fuzz(addresses: dict[str, str], requests: int, seconds: float, concurrency: int, timeout: float,
               seed: int) -> dict:
    channels = {name: grpc.aio.insecure_channel(addr) for name, addr in addresses.items()}
    calls = make_calls(channels)
    counts: Counter = Counter()  # (method, status) -> calls
    examples: dict[str, str] = {}  # a request that got a bad status, per method
    sent = 0
    start = time.monotonic()
    stop_at = start + seconds

    async def runner(n: int) -> None:
        nonlocal sent
        rng = random.Random(seed * 1000 + n)
        while sent < requests and time.monotonic() < stop_at:
            sent += 1
            name, method, make, streaming = rng.choice(calls)
            request = make(rng)
            status = await one_call(method, request, streaming, timeout)
            counts[(name, status)] += 1
            if status in BAD_STATUSES and name not in examples:
                examples[name] = str(request)[:500]

    await asyncio.gather(*(runner(n) for n in range(concurrency)))
    elapsed = time.monotonic() - start
    health = {}
    for name, channel in channels.items():
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            health[name] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as e:
            health[name] = e.code().name
    for channel in channels.values():
        await channel.close()
    by_status = Counter()
    for (_, status), n in counts.items():
        by_status[status] += n
    return {"requests": sent, "seconds": round(elapsed, 1), "by_status": dict(by_status),
            "by_method": {f"{m} {s}": n for (m, s), n in sorted(counts.items())},
            "bad": sum(by_status[s] for s in BAD_STATUSES), "health_after": health, "bad_examples": examples}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--start", action="store_true", help="start a stack of its own on the tiny demo checkpoint")
    for name, port in (("gateway", 50051), ("tokenizer", 50052), ("worker", 50053)):
        parser.add_argument(f"--{name}-addr", default=f"127.0.0.1:{port}", help=f"{name} host:port on this machine")
    parser.add_argument("--requests", type=int, default=10_000, help="requests to send (default: 10000)")
    parser.add_argument("--seconds", type=float, default=60.0, help="stop sending after this long (default: 60)")
    parser.add_argument("--concurrency", type=int, default=32, help="calls in flight (default: 32)")
    parser.add_argument("--timeout", type=float, default=5.0, help="deadline of each call, seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.seconds <= 0 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be >= 1 and --seconds > 0")

    with tempfile.TemporaryDirectory(prefix="fuzz-") as work:
        stack = None
        if args.start:
            stack = start_stack(work)
            addresses = {s.name: s.address for s in stack.services}
        else:
            addresses = {"gateway": args.gateway_addr, "tokenizer": args.tokenizer_addr, "worker": args.worker_addr}
            for addr in addresses.values():
                check_loopback(addr)
        try:
            result = asyncio.run(fuzz(addresses, args.requests, args.seconds, args.concurrency, args.timeout,
                                      args.seed))
            if stack is not None:
                result["exited"] = {s.name: s.process.returncode for s in stack.services
                                    if s.process.poll() is not None}
        finally:
            if stack is not None:
                stack.stop()
    print(f"{result['requests']} requests in {result['seconds']} s; by status: {result['by_status']}")
    print(f"UNKNOWN or INTERNAL: {result['bad']}; health after: {result['health_after']}")
    print(json.dumps(result, ensure_ascii=False))
    serving = all(status == "SERVING" for status in result["health_after"].values())
    sys.exit(1 if result["bad"] or not serving or result.get("exited") else 0)


if __name__ == "__main__":
    main()
