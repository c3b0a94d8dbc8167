"""What one message costs in grpc's Python layer: CPU per round trip on an open bidirectional stream.

A server process echoes DecodeBatches messages (a reply per request, no work); this process
writes one and reads the reply, N times. Both processes' CPU time per round trip is the floor
under any service hop the gateway makes per token: nothing of the project's own code runs.

    python -m bench.bench_grpc_floor               # 4,000 round trips, 3 rounds
    python -m bench.bench_grpc_floor --unix        # the same over a Unix-domain socket
    python -m bench.bench_grpc_floor --interval-ms 3 --count 800
        # one round trip every 3 ms, a single stream's token pace: each message then wakes
        # sleeping threads on both sides, and costs more CPU than back to back
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from bench.cpu_meter import process_tree_cpu  # noqa: E402
from vllm_v0.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc  # noqa: E402


class Echo(tokenizer_pb2_grpc.TokenizerServiceServicer):
    async def DecodeBatches(self, requests, context):
        async for _ in requests:
            yield tokenizer_pb2.DecodeBatchResponse(results=[tokenizer_pb2.DecodeBatchResult(stream_id=1, text="x")])


def serve(ready, address: str) -> None:
    async def run():
        server = grpc.aio.server()
        tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(Echo(), server)
        port = server.add_insecure_port(address)
        await server.start()
        ready.put(address if address.startswith("unix:") else f"127.0.0.1:{port}")
        await server.wait_for_termination()
    asyncio.run(run())


async def round_trips(address: str, count: int, server_pid: int,
                      interval_s: float = 0.0) -> tuple[float, float, float]:
    """(wall µs, client CPU µs, server CPU µs) per round trip, with `interval_s` of sleep after each one."""
    request = tokenizer_pb2.DecodeBatchRequest(items=[tokenizer_pb2.DecodeBatchItem(stream_id=1, token_ids=[9])])
    async with grpc.aio.insecure_channel(address) as channel:
        call = tokenizer_pb2_grpc.TokenizerServiceStub(channel).DecodeBatches()
        for _ in range(200):  # untimed: connection, first allocations
            await call.write(request)
            await call.read()
        server_before, client_before, start = process_tree_cpu(server_pid), time.process_time(), time.perf_counter()
        for _ in range(count):
            await call.write(request)
            await call.read()
            if interval_s:
                await asyncio.sleep(interval_s)
        wall, client = time.perf_counter() - start, time.process_time() - client_before
        server = process_tree_cpu(server_pid) - server_before
        await call.done_writing()
    return wall * 1e6 / count, client * 1e6 / count, server * 1e6 / count


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=4000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--unix", action="store_true", help="over a Unix-domain socket instead of loopback TCP")
    p.add_argument("--interval-ms", type=float, default=0.0, help="sleep between round trips (default: back to back)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        listen = f"unix://{tmp}/floor.sock" if args.unix else "127.0.0.1:0"
        ready = multiprocessing.Queue()
        server = multiprocessing.Process(target=serve, args=(ready, listen), daemon=True)
        server.start()
        try:
            address = ready.get(timeout=60)
            runs = [asyncio.run(round_trips(address, args.count, server.pid, args.interval_ms / 1000))
                    for _ in range(args.repeats)]
        finally:
            server.kill()
    names = ("wall", "client CPU", "server CPU")
    medians = {n: statistics.median(r[i] for r in runs) for i, n in enumerate(names)}
    print(f"grpc {grpc.__version__}, grpc.aio on both sides, {'Unix socket' if args.unix else 'loopback TCP'}, "
          f"{args.count} round trips x {args.repeats}, "
          f"{f'one every {args.interval_ms:g} ms + its own time' if args.interval_ms else 'back to back'}, "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    for name, value in medians.items():
        print(f"  {name:12s} {value:7.1f} µs per round trip (per round: "
              f"{', '.join(f'{r[names.index(name)]:.1f}' for r in runs)})")
    print(json.dumps({"benchmark": "bench_grpc_floor", "us_per_round_trip": medians, "count": args.count,
                      "repeats": args.repeats, "interval_ms": args.interval_ms,
                      "transport": "unix" if args.unix else "tcp"}))


if __name__ == "__main__":
    main()
