"""What the gateway costs per token: the worker directly, the gateway over gRPC and over HTTP, side by side.

Starts the tokenizer, worker and gateway (with --http-port) as subprocesses on a tiny random
Qwen3 with the real Qwen3 vocabulary, so the model's step is cheap and the services' cost
shows. In interleaved rounds it streams greedy completions (ignore_eos, fixed length):
  - worker: token ids straight from ModelWorkerService.Generate;
  - gateway-grpc: text from GatewayService.Generate;
  - gateway-http: server-sent events from POST /v1/completions (a bare asyncio HTTP client,
    so the client's own cost stays small);
at 1 stream (time per token after the first) and at 16 concurrent streams (aggregate tok/s).
It also times detokenization alone against the tokenizer service: one unary
DecodeIncremental call per token (the gateway's first path), one DecodeStream call per
request, and one DecodeBatches call carrying 16 streams, one message per step (the gateway's
path now). It counts the engine core's involuntary context switches in each run: how often
something else took its CPU mid-step. Medians with min-max. The gateway's figures against the
worker's are paired by round (every round runs each mode back to back, in an order that rotates
from round to round): the added ms per token and the share of the worker's tok/s are the medians
of the per-round figures. The tokenizer and gateway run at the --nice scripts/up.sh gives them (10
when every process shares every CPU). The last line is one JSON object.

    python -m bench.bench_gateway                  # a few minutes
    python -m bench.bench_gateway --engine-cpus 1  # the engine core on CPU 1, the rest on the others
    python -m bench.bench_gateway --nice 0         # sharing every CPU, the tokenizer and gateway not lowered
    python -m bench.bench_gateway --quick          # a smoke check
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

from bench.bench_serving import make_text, word_pool  # noqa: E402
from bench.cpu_meter import CpuMeter, preemptions  # noqa: E402
from demo.vocab import write_tokenizer_files  # noqa: E402
from services.model_worker.host.cpu_affinity import format_cpu_list, keep_process_off, others, parse_cpu_list  # noqa: E402
from services.tokenizer.core import TokenizerCore  # noqa: E402
from tests.checkpoints import make_checkpoint  # noqa: E402
from tests.integration.stack import child_pids, free_port, make_stack  # noqa: E402
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc  # noqa: E402
from vllm_v0.tokenizer.v1 import tokenizer_pb2, tokenizer_pb2_grpc  # noqa: E402
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

# With the engine core on CPUs of its own (--engine-cpus); sharing every CPU, the share of the worker's tok/s
# has its own, lower target.
TARGETS = {"overhead_ms_per_token_grpc_1": 0.3, "grpc_vs_worker_16": 0.95}
TARGETS_SHARED = {"grpc_vs_worker_16": 0.85}
MODES = ("worker", "gateway-grpc", "gateway-http")
BATCH_STREAMS = 16  # streams per DecodeBatches message in the detokenization timing
UP_SH_NICE = 10  # the tokenizer's and gateway's --nice in scripts/up.sh when the engine shares their CPUs


def tiny_checkpoint(path: pathlib.Path) -> pathlib.Path:
    write_tokenizer_files(path)
    make_checkpoint(path, vocab_size=151936, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, eos_token_id=(151645, 151643))
    return path


async def worker_stream(stub, prompt_ids: list[int], new_tokens: int) -> list[float]:
    stamps = []
    request = worker_pb2.GenerateRequest(prompt_token_ids=prompt_ids, max_tokens=new_tokens, ignore_eos=True,
                                         sampling=worker_pb2.SamplingParams(temperature=0.0))
    async for _ in stub.Generate(request):
        stamps.append(time.perf_counter())
    return stamps


async def grpc_stream(stub, text: str, new_tokens: int) -> list[float]:
    stamps = []
    request = gateway_pb2.GenerateRequest(prompt=text, max_tokens=new_tokens, temperature=0, ignore_eos=True)
    async for message in stub.Generate(request):
        stamps.extend(time.perf_counter() for _ in message.token_ids)
    return stamps


def completion_body(text: str, new_tokens: int) -> bytes:
    # An empty model name is the served model, as in vLLM; any other name but the served one is a 404.
    # Usage in every chunk: an event may carry several tokens (the gateway merges those that come faster
    # than events go out), and its completion_tokens says how many so far.
    return json.dumps({"model": "", "prompt": text, "max_tokens": new_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}}).encode()


async def http_stream(port: int, text: str, new_tokens: int) -> list[float]:
    """POST /v1/completions with stream: true; one stamp per token, each event's tokens stamped at its arrival."""
    body = completion_body(text, new_tokens)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    status = await reader.readline()
    if status.split()[1:2] != [b"200"]:
        # A refused request has no events: timing it would report nothing, or a figure for nothing.
        writer.close()
        raise RuntimeError(f"POST /v1/completions answered {status.decode(errors='replace').strip()!r}")
    stamps = []
    async for line in reader:  # chunked framing lines are skipped: only event lines start with `data:`
        if line.startswith(b"data: {"):
            now, tokens = time.perf_counter(), json.loads(line[6:])["usage"]["completion_tokens"]
            stamps.extend(now for _ in range(tokens - len(stamps)))
        elif line.startswith(b"data: [DONE]"):
            break
    writer.close()
    return stamps


class Clients:
    def __init__(self, stack, http_port: int):
        self.gateway_channel = grpc.aio.insecure_channel(stack.gateway.address)
        self.worker_channel = grpc.aio.insecure_channel(stack.worker.address)
        self.gateway = gateway_pb2_grpc.GatewayServiceStub(self.gateway_channel)
        self.worker = worker_pb2_grpc.ModelWorkerServiceStub(self.worker_channel)
        self.http_port = http_port

    def stream(self, mode: str, text: str, prompt_ids: list[int], new_tokens: int):
        if mode == "worker":
            return worker_stream(self.worker, prompt_ids, new_tokens)
        if mode == "gateway-grpc":
            return grpc_stream(self.gateway, text, new_tokens)
        return http_stream(self.http_port, text, new_tokens)

    async def close(self):
        await self.gateway_channel.close()
        await self.worker_channel.close()


async def one_stream(clients: Clients, mode: str, text: str, prompt_ids: list[int], new_tokens: int) -> float:
    """Milliseconds per token after the first."""
    stamps = await clients.stream(mode, text, prompt_ids, new_tokens)
    assert len(stamps) == new_tokens, (mode, len(stamps))
    return (stamps[-1] - stamps[0]) * 1000 / (len(stamps) - 1)


async def many_streams(clients: Clients, mode: str, texts: list[str], prompts: list[list[int]],
                       new_tokens: int) -> float:
    """Aggregate tokens/s of concurrent streams, from the first request to the last token."""
    start = time.perf_counter()
    runs = await asyncio.gather(*(clients.stream(mode, t, p, new_tokens) for t, p in zip(texts, prompts)))
    assert all(len(r) == new_tokens for r in runs), mode
    return sum(len(r) for r in runs) / (max(r[-1] for r in runs) - start)


async def decode_per_token(address: str, ids: list[int], repeats: int) -> dict[str, list[float]]:
    """Microseconds per token to detokenize `ids` one at a time: unary DecodeIncremental vs DecodeStream,
    and DecodeBatches with BATCH_STREAMS streams of `ids` (one message per BATCH_STREAMS tokens)."""
    out = {"unary DecodeIncremental": [], "DecodeStream": [], f"DecodeBatches, {BATCH_STREAMS} streams": []}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        for _ in range(repeats):
            start, window, read_offset, texts = time.perf_counter(), [], 0, []
            for i, token_id in enumerate(ids):
                window.append(token_id)
                reply = await stub.DecodeIncremental(tokenizer_pb2.DecodeIncrementalRequest(
                    token_ids=window, read_offset=read_offset, skip_special_tokens=True, final=i == len(ids) - 1))
                del window[:reply.prefix_advance]
                read_offset = reply.read_offset
                texts.append(reply.text)
            out["unary DecodeIncremental"].append((time.perf_counter() - start) * 1e6 / len(ids))
            unary_text = "".join(texts)

            start, texts = time.perf_counter(), []
            call = stub.DecodeStream()
            for i, token_id in enumerate(ids):
                await call.write(tokenizer_pb2.DecodeStreamRequest(token_ids=[token_id], skip_special_tokens=i == 0,
                                                                   final=i == len(ids) - 1))
                texts.append((await call.read()).text)
            await call.done_writing()
            out["DecodeStream"].append((time.perf_counter() - start) * 1e6 / len(ids))
            assert "".join(texts) == unary_text

            start, texts = time.perf_counter(), [[] for _ in range(BATCH_STREAMS)]
            call = stub.DecodeBatches()
            for i, token_id in enumerate(ids):
                await call.write(tokenizer_pb2.DecodeBatchRequest(items=[tokenizer_pb2.DecodeBatchItem(
                    stream_id=s, token_ids=[token_id], skip_special_tokens=True, final=i == len(ids) - 1)
                    for s in range(BATCH_STREAMS)]))
                for result in (await call.read()).results:
                    texts[result.stream_id].append(result.text)
            await call.done_writing()
            out[f"DecodeBatches, {BATCH_STREAMS} streams"].append(
                (time.perf_counter() - start) * 1e6 / (len(ids) * BATCH_STREAMS))
            assert all("".join(t) == unary_text for t in texts)
    return out


def paired(raw: dict, mode: str, figure) -> list[float]:
    """figure(mode's value, the worker's value) for each round."""
    return [figure(value, worker) for value, worker in zip(raw[mode], raw["worker"])]


def stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def show(values: dict) -> str:
    return f"{values['median']:9.3f} ({values['min']:.3f}-{values['max']:.3f})"


async def measured(meter: CpuMeter, cpu: dict, mode: str, run, core_pid: int, preempted: dict) -> float:
    """Run one measurement, adding each process's CPU milliseconds per token to cpu[mode] and the engine
    core's preemptions to preempted[mode]; returns its figure."""
    meter.start()
    switches = preemptions(core_pid)
    figure, tokens = await run
    preempted[mode].append(preemptions(core_pid) - switches)
    used = meter.stop()
    for name, seconds in used.items():
        cpu[mode].setdefault(name, []).append(seconds * 1000 / tokens)
    return figure


async def run(args, stack, http_port: int, tokenizer: TokenizerCore) -> dict:
    rng = random.Random(0)
    words = word_pool(tokenizer)
    texts = [make_text(rng, words, tokenizer, args.prompt_tokens) for _ in range(args.streams)]
    prompts = [tokenizer.encode(t) for t in texts]
    clients = Clients(stack, http_port)
    single = {m: [] for m in MODES}
    batched = {m: [] for m in MODES}
    cpu = {m: {} for m in MODES}  # CPU ms per token at 1 stream, by process
    cpu_many = {m: {} for m in MODES}  # and at args.streams streams
    meter = CpuMeter({"tokenizer": stack.tokenizer.process.pid, "worker": stack.worker.process.pid,
                      "gateway": stack.gateway.process.pid})
    (core_pid,) = child_pids(stack.worker.process.pid)
    preempted = {m: [] for m in MODES}  # the engine core's involuntary context switches per run, at 1 stream
    preempted_many = {m: [] for m in MODES}  # and at args.streams streams
    try:
        for mode in MODES:  # untimed: connections, first-call allocations
            await one_stream(clients, mode, texts[0], prompts[0], 4)
        for round_ in range(args.repeats):
            for mode in round_order(round_):
                single[mode].append(await measured(meter, cpu, mode, counted(
                    one_stream(clients, mode, texts[0], prompts[0], args.new_tokens), args.new_tokens),
                    core_pid, preempted))
            for mode in round_order(round_):
                batched[mode].append(await measured(meter, cpu_many, mode, counted(
                    many_streams(clients, mode, texts, prompts, args.new_tokens), args.streams * args.new_tokens),
                    core_pid, preempted_many))
            print(f"round {round_ + 1}: 1 stream ms/token " +
                  "  ".join(f"{m} {single[m][-1]:.3f}" for m in MODES) + f" | {args.streams} streams tok/s " +
                  "  ".join(f"{m} {batched[m][-1]:.0f}" for m in MODES), flush=True)
        sample = tokenizer.encode("Emoji 🎉🚀 and 日本語 mixed with plain words " * 8)
        decode = await decode_per_token(stack.tokenizer.address, sample, args.repeats)
    finally:
        await clients.close()
    return {"single_ms_per_token": single, "streams_tok_s": batched, "decode_us_per_token": decode,
            "cpu_ms_per_token_1": cpu, "cpu_ms_per_token_many": cpu_many,
            "engine_core_preempted_1": preempted, "engine_core_preempted_many": preempted_many}


def round_order(round_: int) -> tuple[str, ...]:
    """The modes in the order round `round_` runs them: each takes each place in turn, so no mode
    always runs first (on a machine just idle) or right after the heaviest run."""
    shift = round_ % len(MODES)
    return MODES[shift:] + MODES[:shift]


async def counted(measurement, tokens: int) -> tuple[float, int]:
    return await measurement, tokens


def cpu_table(raw: dict, label: str) -> dict:
    """Print CPU ms per token by mode and process (medians); return their stats."""
    print(f"\nCPU ms per token {label}, by process (the worker with its engine core; client: this script):")
    names = list(next(iter(raw.values())))
    print(f"{'':14s}" + "".join(f"{n:>12s}" for n in names))
    for mode in MODES:
        print(f"{mode:14s}" + "".join(f"{statistics.median(raw[mode][n]):12.3f}" for n in names))
    return {m: {n: stats(v) for n, v in by_name.items()} for m, by_name in raw.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--repeats", type=int, default=9, help="interleaved rounds (a multiple of 3 gives each "
                   "mode each place in the order equally often)")
    p.add_argument("--quick", action="store_true", help="one short round")
    p.add_argument("--engine-cpus", default="", help="the worker's --engine-cpus, e.g. 1: the engine core on CPUs "
                   "of its own, every other process on the rest (default: all share every CPU)")
    p.add_argument("--nice", type=int, default=None, help="the tokenizer's and gateway's --nice (default: as "
                   "scripts/up.sh starts them, 10 where every process shares every CPU, 0 with --engine-cpus)")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.new_tokens = 1, 32
    started, load_before = time.perf_counter(), os.getloadavg()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    checkpoint = tiny_checkpoint(tmp / "tiny")
    tokenizer = TokenizerCore.from_dir(checkpoint)
    http_port = free_port()
    worker_flags = ["--max-num-seqs", str(max(args.streams, 1))]
    if args.engine_cpus:
        worker_flags += ["--engine-cpus", args.engine_cpus]
    if args.nice is None:
        args.nice = 0 if args.engine_cpus else UP_SH_NICE
    nice = ["--nice", str(args.nice)]
    stack = make_stack(str(checkpoint), str(tmp), worker_flags=worker_flags,
                       gateway_flags=["--http-port", str(http_port), *nice], tokenizer_flags=nice)
    placement = "every process on every CPU"
    if args.engine_cpus:
        # As an operator would with taskset or a compose cpuset: the tokenizer, the gateway and this
        # client on the CPUs the engine core does not use (the worker moves its own front there).
        engine = parse_cpu_list(args.engine_cpus)
        stack.tokenizer.cpus = stack.gateway.cpus = others(engine) or None
    stack.start(timeout=600)
    if args.engine_cpus:
        rest = keep_process_off(engine)
        placement = f"engine core on CPUs {format_cpu_list(engine)}, the rest on " + \
            (format_cpu_list(rest) if rest else "them too (no other CPU)")
    placement += f"; tokenizer and gateway at --nice {args.nice}"
    print(f"prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, greedy; {args.repeats} rounds; "
          f"load average {' '.join(f'{x:.2f}' for x in load_before)} on {os.cpu_count()} CPUs; {placement}",
          flush=True)
    try:
        raw = asyncio.run(run(args, stack, http_port, tokenizer))
    finally:
        stack.stop()

    single = {m: stats(v) for m, v in raw["single_ms_per_token"].items()}
    batched = {m: stats(v) for m, v in raw["streams_tok_s"].items()}
    decode = {m: stats(v) for m, v in raw["decode_us_per_token"].items()}
    print(f"\n{'':14s}{'1 stream, ms/token':>28s}{f'{args.streams} streams, tok/s':>30s}")
    for mode in MODES:
        print(f"{mode:14s}{show(single[mode]):>28s}{show(batched[mode]):>30s}")
    cpu_1 = cpu_table(raw["cpu_ms_per_token_1"], "at 1 stream")
    cpu_many = cpu_table(raw["cpu_ms_per_token_many"], f"at {args.streams} streams")
    preempted = {"1": {m: stats(v) for m, v in raw["engine_core_preempted_1"].items()},
                 str(args.streams): {m: stats(v) for m, v in raw["engine_core_preempted_many"].items()}}
    print("\nthe engine core's involuntary context switches per run (preempted while runnable):")
    for streams, by_mode in preempted.items():
        print(f"  {streams:>2s} stream{'s' if streams != '1' else ' '}  " +
              "  ".join(f"{m} {by_mode[m]['median']:.0f}" for m in MODES))
    print("\ndetokenization alone, µs per token:")
    for name, value in decode.items():
        print(f"  {name:26s}{show(value)}")
    # Each round measures every mode back to back, so the gateway's figures are paired with the
    # worker's of the same round: the median of those pairs, not a ratio of medians taken from
    # different rounds of a machine whose speed drifts.
    per_round = {
        "overhead_ms_per_token_grpc_1": paired(raw["single_ms_per_token"], "gateway-grpc", lambda g, w: g - w),
        "overhead_ms_per_token_http_1": paired(raw["single_ms_per_token"], "gateway-http", lambda g, w: g - w),
        "grpc_vs_worker_16": paired(raw["streams_tok_s"], "gateway-grpc", lambda g, w: g / w),
        "http_vs_worker_16": paired(raw["streams_tok_s"], "gateway-http", lambda g, w: g / w),
    }
    ratios = {
        **{name: statistics.median(values) for name, values in per_round.items()},
        "decode_stream_vs_unary": decode["DecodeStream"]["median"] / decode["unary DecodeIncremental"]["median"],
        "decode_batches_vs_stream": decode[f"DecodeBatches, {BATCH_STREAMS} streams"]["median"]
        / decode["DecodeStream"]["median"],
    }
    targets = TARGETS if args.engine_cpus else TARGETS_SHARED
    print()
    for name, value in ratios.items():
        target = targets.get(name)
        verdict = ""
        if target is not None:
            met = value <= target if name.startswith("overhead") else value >= target
            verdict = f"  target {'<=' if name.startswith('overhead') else '>='} {target}: " \
                      f"{'met' if met else 'MISSED'}"
        rounds = f"  (per round: {', '.join(f'{v:.3f}' for v in per_round[name])})" if name in per_round else ""
        print(f"  {name:32s} {value:7.3f}{verdict}{rounds}")
    print(json.dumps({"benchmark": "bench_gateway", "machine": {
        "cpus": os.cpu_count(), "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "settings": {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "streams": args.streams,
                     "repeats": args.repeats, "engine_cpus": args.engine_cpus or "all",
                     "nice": args.nice, "placement": placement},
        "single_ms_per_token": single, "streams_tok_s": batched, "decode_us_per_token": decode,
        "cpu_ms_per_token_1": cpu_1, "cpu_ms_per_token_many": cpu_many,
        "engine_core_preempted": preempted, "ratios": ratios, "per_round": per_round, "targets": targets,
        "wall_s": time.perf_counter() - started}))


if __name__ == "__main__":
    main()
