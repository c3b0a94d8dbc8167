"""A stand-in model worker with no model: ModelWorkerService streaming a fixed cycle of token ids as fast as
its reader takes them, so a benchmark of the gateway measures the gateway alone.

It answers what the gateway asks of a worker (health, GetInfo, WatchLoad, Generate, GenerateMany) with
the worker's rules: one output per step per request, `prompt_tokens` on the first, `finish_reason`
LENGTH on the last (at `max_tokens`, default 256), cancels honoured. Its messages are built from
pre-encoded bytes, so it costs little CPU per token. Unpaced (--step-ms 0), each GenerateMany message
is one step of every open request, sent as soon as the previous one is written; paced, an engine step
falls due every --step-ms and a message carries every step due since the last one (at most
--max-merge), as the real worker merges the steps a slow reader missed.

    python -m bench.standin_worker --port 50053 --tokens ids.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time

import grpc

from rpcserver.config import ServerConfig
from rpcserver.server import GrpcServer, setup_logging
from vllm_v0.worker.v1 import worker_pb2

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["ModelWorkerService"].full_name
DEFAULT_MAX_TOKENS = 256
VOCAB_SIZE = 151936
EOS_TOKEN_IDS = (151645, 151643)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


class TokenSteps:
    """Each token's GenerateResponse bytes, plain, first (with prompt_tokens) and last (FINISH_REASON_LENGTH)."""

    def __init__(self, token_ids: list[int]):
        self.ids = token_ids
        self.plain = [self.encode(i) for i in token_ids]

    @staticmethod
    def encode(token_id: int, prompt_tokens: int = 0, last: bool = False) -> bytes:
        step = worker_pb2.GenerateResponse(token_id=token_id, prompt_tokens=prompt_tokens)
        if last:
            step.finish_reason = worker_pb2.FINISH_REASON_LENGTH
        return step.SerializeToString()

    def of(self, prompt_tokens: int, count: int) -> list[bytes]:
        """The GenerateResponse bytes of a request's `count` tokens."""
        cycle = len(self.ids)
        steps = [self.plain[i % cycle] for i in range(count)]
        steps[0] = self.encode(self.ids[0], prompt_tokens, last=count == 1)
        if count > 1:
            steps[-1] = self.encode(self.ids[(count - 1) % cycle], last=True)
        return steps


class Open:
    """One request on a GenerateMany call: its outputs, pre-framed, and how many went out."""

    __slots__ = ("outputs", "sent")

    def __init__(self, wire_id: str, steps: list[bytes]):
        prefix = field(1, wire_id.encode())
        # GenerateManyResponse.outputs (1) holding RequestOutput{request_id (1), step (2)}.
        self.outputs = [field(1, prefix + field(2, step)) for step in steps]
        self.sent = 0


class StandIn:
    def __init__(self, steps: TokenSteps, step_s: float, max_merge: int):
        self.steps = steps
        self.step_s = step_s
        self.max_merge = max_merge

    def request_steps(self, request: worker_pb2.GenerateRequest) -> list[bytes]:
        count = request.max_tokens if request.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        return self.steps.of(len(request.prompt_token_ids), max(1, count))

    async def generate(self, request: worker_pb2.GenerateRequest, context):
        pace = Pace(self.step_s, 1)
        for step in self.request_steps(request):
            await pace.due()
            yield step

    async def generate_many(self, requests, context):
        open_: dict[str, Open] = {}
        arrived = asyncio.Event()
        closed = False

        async def read() -> None:
            nonlocal closed
            async for message in requests:
                if message.HasField("start"):
                    open_[message.start.request_id] = Open(message.start.request_id,
                                                          self.request_steps(message.start))
                else:
                    open_.pop(message.cancel, None)
                arrived.set()
            closed = True
            arrived.set()

        reader = asyncio.create_task(read())
        pace = Pace(self.step_s, self.max_merge)
        try:
            while True:
                if not open_:
                    if closed:
                        return
                    arrived.clear()
                    await arrived.wait()
                    continue
                merged = await pace.due()
                chunks = []
                for wire_id, request in list(open_.items()):
                    end = min(request.sent + merged, len(request.outputs))
                    chunks.extend(request.outputs[request.sent:end])
                    request.sent = end
                    if end == len(request.outputs):
                        del open_[wire_id]
                yield b"".join(chunks)
        finally:
            reader.cancel()

    async def get_info(self, request, context) -> worker_pb2.GetInfoResponse:
        return worker_pb2.GetInfoResponse(
            model="standin", dtype="bfloat16", device="none", max_context=1 << 16, vocab_size=VOCAB_SIZE,
            eos_token_ids=EOS_TOKEN_IDS, running=0, waiting=0, kv_blocks_used=0, kv_blocks_free=1 << 16,
            block_size=16, prefix_cache_hit_rate=0.0, tokens_after_cancel=0, max_logprobs=20)

    async def watch_load(self, request, context):
        yield worker_pb2.LoadUpdate(reset=True, block_size=16, kv_blocks_free=1 << 16)
        await asyncio.Event().wait()  # no load changes: open until the caller or the server ends it


class Pace:
    """When the next message may go: at once unpaced; paced, once a step is due, with the count due (capped)."""

    def __init__(self, step_s: float, max_merge: int):
        self.step_s = step_s
        self.max_merge = max_merge
        self.start = time.monotonic()
        self.steps = 0

    async def due(self) -> int:
        if not self.step_s:
            return 1
        while True:
            due = int((time.monotonic() - self.start) / self.step_s) - self.steps
            if due > 0:
                # Steps past the cap are lost, as an engine that outran its reader would have waited instead.
                self.steps += due
                return min(due, self.max_merge)
            await asyncio.sleep(self.start + (self.steps + 1) * self.step_s - time.monotonic())


def handlers(stand_in: StandIn) -> grpc.GenericRpcHandler:
    raw = None  # the handler yields bytes already encoded
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Generate": grpc.unary_stream_rpc_method_handler(
            stand_in.generate, request_deserializer=worker_pb2.GenerateRequest.FromString, response_serializer=raw),
        "GenerateMany": grpc.stream_stream_rpc_method_handler(
            stand_in.generate_many, request_deserializer=worker_pb2.GenerateManyRequest.FromString,
            response_serializer=raw),
        "GetInfo": grpc.unary_unary_rpc_method_handler(
            stand_in.get_info, request_deserializer=worker_pb2.GetInfoRequest.FromString,
            response_serializer=worker_pb2.GetInfoResponse.SerializeToString),
        "WatchLoad": grpc.unary_stream_rpc_method_handler(
            stand_in.watch_load, request_deserializer=worker_pb2.WatchLoadRequest.FromString,
            response_serializer=worker_pb2.LoadUpdate.SerializeToString),
    })


async def serve(args: argparse.Namespace) -> None:
    token_ids = json.loads(open(args.tokens).read()) if args.tokens else list(range(1000, 1512))
    stand_in = StandIn(TokenSteps(token_ids), args.step_ms / 1000, args.max_merge)
    config = ServerConfig(args.host, args.port, grace_period_s=1.0, max_message_bytes=64 << 20, tls_cert=None,
                          tls_key=None, tls_client_ca=None, log_level=args.log_level)
    server = GrpcServer(config, [SERVICE])
    server.server.add_generic_rpc_handlers((handlers(stand_in),))
    await server.start()
    await server.set_serving(True)
    await server.run_until_signal()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", default="", help="a JSON list of token ids to stream, cycled")
    p.add_argument("--step-ms", type=float, default=0.0, help="one engine step every this many ms (0: as fast as "
                   "the reader takes them)")
    p.add_argument("--max-merge", type=int, default=64, help="most steps one paced message carries")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args(argv)
    setup_logging(args.log_level)
    logging.getLogger("rpcserver").setLevel(args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
