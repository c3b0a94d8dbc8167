"""The gateway's ceiling in tokens/s: the real gateway and tokenizer in front of a stand-in worker with no model.

The stand-in (bench/standin_worker.py) streams token ids of real text as fast as its reader takes
them, so the gateway, not a model, sets the pace. At 1, 64 and 256 concurrent streams, in
interleaved rounds, client processes (grpc.aio, and a bare asyncio HTTP client) read:
  - standin: the stand-in's GenerateMany directly (its own rate, what the gateway reads from);
  - gateway-grpc: GatewayService.Generate;
  - gateway-http: POST /v1/completions with stream: true (server-sent events).
Each stream generates a fixed number of tokens (ignore_eos; --tokens split over the streams, 1,024
at 256 streams by default, 4,096 at 1 and 64); a run's rate is every stream's tokens over the time
from the common start to the last token. Streams of 256 tokens time mostly each request's setup
(its encode, its start on the worker, the first token alone), not the steady state. Before timing, one pass at 8 streams
checks that the gateway's token ids and text equal the stand-in's ids and their full decode.
Also reported: the CPU each process spends per token (on a machine with fewer cores than
processes, the figure that does not depend on who got the CPU), and the tokens per message each
client received (the gateway's coalescing). The last line is one JSON object.

    python -m bench.bench_gateway_ceiling                      # a few minutes
    python -m bench.bench_gateway_ceiling --quick              # a smoke check
    python -m bench.bench_gateway_ceiling --profile prof/      # cProfile the gateway and the tokenizer
    python -m bench.bench_gateway_ceiling --step-ms 1          # a stand-in engine stepping every ms
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import pathlib
import random
import re
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from bench.bench_serving import make_text, word_pool  # noqa: E402
from bench.cpu_kind import cpu_description, cpu_kind  # noqa: E402
from bench.cpu_meter import CpuMeter  # noqa: E402
from demo.vocab import write_tokenizer_files  # noqa: E402
from services.tokenizer.core import TokenizerCore  # noqa: E402
from tests.integration.stack import Service, Stack, free_port  # noqa: E402
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

MODES = ("standin", "gateway-grpc", "gateway-http")
TARGETS = {"grpc_tok_s_256": 100_000, "grpc_vs_standin_64": 0.9}
PROMPT_TOKENS = 16
CYCLE_TOKENS = 1024  # the stand-in's token ids, cycled: real words, so detokenizing them is real work
CHECK_STREAMS = 8
USAGE = re.compile(rb'"completion_tokens":\s*(\d+)')


# ---- clients (run in client processes) ----

async def standin_streams(address: str, prompt_ids: list[int], streams: int, tokens: int, start_at: float):
    """Every stream on one GenerateMany call, as the gateway uses the worker; (tokens, messages, end time)."""
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = worker_pb2_grpc.ModelWorkerServiceStub(channel)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        call = stub.GenerateMany()
        for i in range(streams):
            await call.write(worker_pb2.GenerateManyRequest(start=worker_pb2.GenerateRequest(
                request_id=str(i), prompt_token_ids=prompt_ids, max_tokens=tokens)))
        got, expected = 0, streams * tokens
        while got < expected:
            response = await call.read()
            if response is grpc.aio.EOF:
                raise RuntimeError(f"the stand-in ended the call after {got} of {expected} tokens")
            got += len(response.outputs)
        end = time.time()
        await call.done_writing()
    return got, got, end  # one output per token: each stream's step is a message of its own to the gateway


async def grpc_stream(stub, text: str, tokens: int) -> tuple[int, int, float]:
    got = messages = 0
    request = gateway_pb2.GenerateRequest(prompt=text, max_tokens=tokens, temperature=0, ignore_eos=True)
    async for message in stub.Generate(request):
        got += len(message.token_ids)
        messages += 1
    return got, messages, time.time()


def completion_body(text: str, tokens: int) -> bytes:
    return json.dumps({"model": "", "prompt": text, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()


async def http_stream(port: int, text: str, tokens: int) -> tuple[int, int, float]:
    """Counts events without parsing them (the client must stay cheap); the usage chunk gives the tokens."""
    body = completion_body(text, tokens)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    if head.split()[1:2] != [b"200"]:
        writer.close()
        raise RuntimeError(f"POST /v1/completions answered {head.splitlines()[0].decode(errors='replace')!r}")
    events, tail = 0, b""
    while block := await reader.read(1 << 16):
        events += (tail[-6:] + block).count(b"data: {")  # an event's mark may straddle two reads
        tail = (tail + block)[-4096:]
    writer.close()
    end = time.time()
    counts = USAGE.findall(tail)
    if not counts or b"data: [DONE]" not in tail:
        raise RuntimeError("the event stream ended without its usage chunk and [DONE]")
    return int(counts[-1]), events - 1, end  # the usage chunk is not a delta


async def gateway_streams(mode: str, address: str, http_port: int, text: str, streams: int, tokens: int,
                          start_at: float):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        await channel.channel_ready()
        await asyncio.sleep(max(0.0, start_at - time.time()))
        if mode == "gateway-grpc":
            runs = await asyncio.gather(*(grpc_stream(stub, text, tokens) for _ in range(streams)))
        else:
            runs = await asyncio.gather(*(http_stream(http_port, text, tokens) for _ in range(streams)))
    if any(got != tokens for got, _, _ in runs):
        raise RuntimeError(f"{mode}: streams got {sorted({g for g, _, _ in runs})} tokens, not {tokens}")
    return sum(r[0] for r in runs), sum(r[1] for r in runs), max(r[2] for r in runs)


def client_run(mode: str, addresses: dict, text: str, prompt_ids: list[int], streams: int, tokens: int,
               start_at: float) -> dict:
    """One client process's share of a run: its tokens, messages, end time and CPU seconds."""
    cpu = time.process_time()
    if mode == "standin":
        got, messages, end = asyncio.run(standin_streams(addresses["standin"], prompt_ids, streams, tokens, start_at))
    else:
        got, messages, end = asyncio.run(gateway_streams(mode, addresses["gateway"], addresses["http_port"], text,
                                                         streams, tokens, start_at))
    return {"tokens": got, "messages": messages, "end": end, "cpu_s": time.process_time() - cpu}


def ready(_=None) -> int:
    return os.getpid()


# ---- the exactness check (this process, untimed) ----

async def check_exact(addresses: dict, text: str, cycle: list[int], tokenizer: TokenizerCore, tokens: int) -> None:
    """The gateway's ids and text against the stand-in's ids and their whole decode, over gRPC and HTTP."""
    expected_ids = [cycle[i % len(cycle)] for i in range(tokens)]
    expected_text = tokenizer.decode(expected_ids, skip_special_tokens=True)
    async with grpc.aio.insecure_channel(addresses["gateway"]) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        async def one_grpc():
            ids, texts = [], []
            async for m in stub.Generate(gateway_pb2.GenerateRequest(prompt=text, max_tokens=tokens, ignore_eos=True)):
                ids.extend(m.token_ids)
                texts.append(m.text)
            return ids, "".join(texts)

        for ids, got in await asyncio.gather(*(one_grpc() for _ in range(CHECK_STREAMS))):
            if ids != expected_ids or got != expected_text:
                raise RuntimeError("gateway-grpc: the stream's ids or text differ from the stand-in's")

    async def one_http():
        body = completion_body(text, tokens)
        reader, writer = await asyncio.open_connection("127.0.0.1", addresses["http_port"])
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        data = await reader.read()
        writer.close()
        chunks = [json.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: {")]
        return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])

    for got in await asyncio.gather(*(one_http() for _ in range(CHECK_STREAMS))):
        if got != expected_text:
            raise RuntimeError("gateway-http: the stream's text differs from the stand-in's")


# ---- the driver ----

def tokens_per_stream(streams: int, total: int) -> int:
    return max(256, min(4096, total // streams))


def run_once(pool, clients: int, meter: CpuMeter, mode: str, addresses: dict, text: str, prompt_ids: list[int],
             streams: int, tokens: int) -> dict:
    """One timed run of `streams` streams split over the client processes."""
    shares = [streams // clients + (i < streams % clients) for i in range(min(clients, streams))]
    if mode == "standin":
        shares = [streams]  # one GenerateMany call carries them all, as the gateway's does
    start_at = time.time() + 0.3  # every client process connected and waiting
    meter.start()
    futures = [pool.submit(client_run, mode, addresses, text, prompt_ids, share, tokens, start_at)
               for share in shares]
    results = [f.result() for f in futures]
    used = meter.stop()
    got = sum(r["tokens"] for r in results)
    seconds = max(r["end"] for r in results) - start_at
    cpu = {name: s for name, s in used.items() if name != "client"}
    cpu["clients"] = sum(r["cpu_s"] for r in results)
    return {"tok_s": got / seconds, "tokens_per_message": got / max(1, sum(r["messages"] for r in results)),
            "cpu_us_per_token": {name: s * 1e6 / got for name, s in cpu.items()}}


def stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(args, modes: tuple[str, ...], stream_counts: list[int], addresses: dict, meter: CpuMeter, text: str,
            prompt_ids: list[int], cycle: list[int], tokenizer: TokenizerCore) -> dict:
    """Every mode at every stream count, `args.repeats` interleaved rounds, after the exactness check."""
    raw = {s: {m: [] for m in modes} for s in stream_counts}
    pool = concurrent.futures.ProcessPoolExecutor(args.clients, mp_context=multiprocessing.get_context("spawn"))
    with pool:
        list(pool.map(ready, range(args.clients)))
        asyncio.run(check_exact(addresses, text, cycle, tokenizer, 300))
        for mode in modes:  # untimed: connections, first allocations
            run_once(pool, args.clients, meter, mode, addresses, text, prompt_ids, 4, 256)
        for round_ in range(args.repeats):
            for streams in stream_counts:
                tokens = tokens_per_stream(streams, args.tokens)
                shift = round_ % len(modes)  # each mode takes each place in the order in turn
                for mode in modes[shift:] + modes[:shift]:
                    raw[streams][mode].append(run_once(pool, args.clients, meter, mode, addresses, text,
                                                       prompt_ids, streams, tokens))
                print(f"round {round_ + 1}, {streams:3d} streams x {tokens} tokens: " + "  ".join(
                    f"{m} {raw[streams][m][-1]['tok_s']:,.0f} tok/s" for m in modes), flush=True)
    return raw


def report(raw: dict, modes: tuple[str, ...], stream_counts: list[int]) -> tuple[dict, dict]:
    """Print the table and the per-process costs; (the table's figures, the targets' figures)."""
    gateways = modes[1:]
    table = {}
    print(f"\n{'streams':>8s}" + "".join(f"{m + ' tok/s':>28s}" for m in modes)
          + "".join(f"{m[8:] + '/standin':>14s}" for m in gateways))
    for streams in stream_counts:
        runs = raw[streams]
        rates = {m: stats([r["tok_s"] for r in runs[m]]) for m in modes}
        # Paired by round: the machine drifts, so each round's gateway run is set against its own stand-in run.
        ratios = {m: statistics.median(g["tok_s"] / s["tok_s"] for g, s in zip(runs[m], runs["standin"]))
                  for m in gateways}
        per_message = {m: statistics.median(r["tokens_per_message"] for r in runs[m]) for m in modes}
        cpu = {m: {name: statistics.median(r["cpu_us_per_token"][name] for r in runs[m])
                   for name in runs[m][0]["cpu_us_per_token"]} for m in modes}
        table[streams] = {"tok_s": rates, "vs_standin": ratios, "tokens_per_message": per_message,
                          "cpu_us_per_token": cpu}
        print(f"{streams:8d}" + "".join(
            f"{rates[m]['median']:,.0f} ({rates[m]['min']:,.0f}-{rates[m]['max']:,.0f})".rjust(28) for m in modes)
            + "".join(f"{ratios[m]:14.3f}" for m in gateways))
    print("\ntokens per message a client received (per stream), and CPU µs per token by process (medians):")
    for streams in stream_counts:
        for m in modes:
            row = table[streams]
            print(f"  {streams:4d} {m:13s} {row['tokens_per_message'][m]:7.2f} tok/msg   " + "  ".join(
                f"{name} {v:7.2f}" for name, v in row["cpu_us_per_token"][m].items()))
    verdicts = {}
    if 256 in table and "gateway-grpc" in modes:
        verdicts["grpc_tok_s_256"] = table[256]["tok_s"]["gateway-grpc"]["median"]
    if 64 in table and "gateway-grpc" in modes:
        verdicts["grpc_vs_standin_64"] = table[64]["vs_standin"]["gateway-grpc"]
    print()
    for name, value in verdicts.items():
        print(f"  {name:22s} {value:12,.3f}  target >= {TARGETS[name]:,}: "
              f"{'met' if value >= TARGETS[name] else 'MISSED'}")
    return table, verdicts


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="1,64,256", help="concurrent stream counts, comma-separated")
    p.add_argument("--tokens", type=int, default=262144, help="tokens per run, split over its streams (each "
                   "stream 256 to 4096; the default gives 1,024 at 256 streams, so a run times the streams' "
                   "steady state rather than their setup)")
    p.add_argument("--modes", default=",".join(MODES), help="what to time, comma-separated: standin (always "
                   "timed: the ratios need it), gateway-grpc, gateway-http")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    p.add_argument("--clients", type=int, default=2, help="client processes for the gateway's streams")
    p.add_argument("--step-ms", type=float, default=0.0, help="the stand-in's step time (0: unpaced)")
    p.add_argument("--gateway-flags", default="", help="extra gateway flags, space-separated")
    p.add_argument("--profile", default="", help="write the gateway's and the tokenizer's cProfile stats (their "
                   "event loop threads' CPU time) to gateway.prof and tokenizer.prof in this folder")
    p.add_argument("--quick", action="store_true", help="one short round")
    args = p.parse_args(argv)
    stream_counts = [int(s) for s in args.streams.split(",")]
    modes = tuple(m for m in MODES if m in args.modes.split(",") or m == "standin")
    if args.quick:
        args.repeats, args.tokens = 1, 4096
    started, load_before = time.perf_counter(), os.getloadavg()

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-ceiling-"))
    write_tokenizer_files(tmp / "tok")
    tokenizer = TokenizerCore.from_dir(tmp / "tok")
    rng = random.Random(0)
    words = word_pool(tokenizer)
    cycle = tokenizer.encode(make_text(rng, words, tokenizer, CYCLE_TOKENS))
    (tmp / "ids.json").write_text(json.dumps(cycle))
    text = make_text(rng, words, tokenizer, PROMPT_TOKENS)
    prompt_ids = tokenizer.encode(text)

    tok_port, standin_port, gw_port, http_port = free_port(), free_port(), free_port(), free_port()
    def module(name: str) -> list[str]:
        if not args.profile:
            return [name]
        pathlib.Path(args.profile).mkdir(parents=True, exist_ok=True)
        return ["bench.profile_module", f"{args.profile}/{name.rsplit('.', 1)[-1]}.prof", name]

    stack = Stack(
        Service("tokenizer", [*module("services.tokenizer"), "--model", str(tmp / "tok"), "--log-level", "WARNING"],
                tok_port, str(tmp / "tokenizer.log")),
        Service("standin", ["bench.standin_worker", "--tokens", str(tmp / "ids.json"),
                            "--step-ms", str(args.step_ms)], standin_port, str(tmp / "standin.log")),
        Service("gateway", [*module("gateway"), "--tokenizer-addr", f"127.0.0.1:{tok_port}", "--worker-addr",
                            f"127.0.0.1:{standin_port}", "--http-port", str(http_port), "--log-level", "WARNING",
                            *args.gateway_flags.split()], gw_port, str(tmp / "gateway.log")))
    stack.start(timeout=120)
    addresses = {"standin": stack.worker.address, "gateway": stack.gateway.address, "http_port": http_port}
    meter = CpuMeter({"gateway": stack.gateway.process.pid, "tokenizer": stack.tokenizer.process.pid,
                      "standin": stack.worker.process.pid})
    print(f"CPU {cpu_description()}, {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in load_before)}; "
          f"{args.clients} client processes; stand-in step {args.step_ms or 'unpaced'}"
          f"{' ms' if args.step_ms else ''}; {args.repeats} rounds", flush=True)
    try:
        raw = measure(args, modes, stream_counts, addresses, meter, text, prompt_ids, cycle, tokenizer)
    finally:
        stack.stop()
    table, verdicts = report(raw, modes, stream_counts)
    print(json.dumps({"benchmark": "bench_gateway_ceiling", "machine": {
        "cpu": cpu_description(), "cpu_kind": cpu_kind(), "cpus": os.cpu_count(), "load_average_before": load_before,
        "load_average_after": os.getloadavg()},
        "settings": {"streams": stream_counts, "tokens_per_run": args.tokens, "repeats": args.repeats,
                     "client_processes": args.clients, "standin_step_ms": args.step_ms,
                     "gateway_flags": args.gateway_flags, "modes": modes},
        "results": {str(s): row for s, row in table.items()}, "verdicts": verdicts, "targets": TARGETS,
        "wall_s": time.perf_counter() - started}))


if __name__ == "__main__":
    main()
