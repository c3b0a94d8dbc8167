"""A long prompt's logprobs on the shared calls, through real grpc.aio servers at gRPC's default 4 MiB limit:
the large request and its neighbour on the same call both finish whole."""
from __future__ import annotations

import asyncio
import random

import grpc

from demo.vocab import load_ranks, ranks_path
from gateway.fleet.worker_mux import WorkerMux
from gateway.text.detokenize import Detokenizer
from rpcserver.handlers import add_servicer
from services.model_worker.engine.llm_engine import StepOutput
from services.model_worker.engine.sequence import FinishReason
from services.model_worker.server.servicer import ModelWorkerServicer
from tests.unit.test_decode_stream import with_server
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

WAIT_S = 60.0  # bounded waits on conditions, never a measure of speed
POSITIONS, CANDIDATES = 40_000, 20  # about 9 MB of prompt logprobs, past the 4 MiB limit twice over


def float32(rng: random.Random) -> float:
    """A logprob a float32 holds exactly, so what comes back can be compared for equality."""
    return -rng.randrange(1, 4096) / 64


def prompt_scores(positions: int, seed: int = 0) -> list:
    """The engine's prompt logprobs: None for the first position, then (logprob, [(id, logprob)] best first)."""
    rng = random.Random(seed)
    return [None] + [(float32(rng), [(rng.randrange(151_936), float32(rng)) for _ in range(CANDIDATES)])
                     for _ in range(positions - 1)]


def as_scores(entries) -> list:
    return [(e.logprob, [(t.token_id, t.logprob) for t in e.top]) if e.HasField("logprob") else None
            for e in entries]


class ScriptedEngine:
    """Stands in for EngineClient: once every expected request is in, plays two steps for all of them, each
    step's outputs handed over in one go, as the engine client dispatches one step's frame."""

    def __init__(self, first_steps: dict[str, StepOutput], after: int = 2):
        self.first_steps = first_steps
        self.after = after
        self.sinks: dict[str, object] = {}
        self.aborted: list[str] = []

    def make_params(self, overrides: dict) -> dict:
        return overrides

    def submit(self, request_id, prompt_ids, params, sink, output_ids=(), adapter="") -> str:
        name = request_id.rsplit("#", 1)[0]
        self.sinks[name] = sink
        if len(self.sinks) == len(self.first_steps):
            asyncio.get_running_loop().call_soon(self._play)
        return name

    def abort(self, engine_id: str) -> None:
        if self.sinks.pop(engine_id, None) is not None:
            self.aborted.append(engine_id)

    def _play(self) -> None:
        for name, out in self.first_steps.items():
            self.sinks[name].put_nowait(out)
        asyncio.get_running_loop().call_soon(self._finish)

    def _finish(self) -> None:
        for name, sink in list(self.sinks.items()):
            sink.put_nowait(StepOutput(name, self.after, None, [], FinishReason.LENGTH, prompt_tokens=0))
            del self.sinks[name]


async def with_worker(engine, body, max_message_bytes: int | None = None):
    """A real worker server on port 0 with its servicer over `engine`; `max_message_bytes` also sets gRPC's limits."""
    options = [] if max_message_bytes is None else [("grpc.max_send_message_length", max_message_bytes),
                                                    ("grpc.max_receive_message_length", max_message_bytes)]
    server = grpc.aio.server(options=options)
    servicer = ModelWorkerServicer("tiny", engine, **({} if max_message_bytes is None
                                                      else {"max_message_bytes": max_message_bytes}))
    add_servicer(server, worker_pb2.DESCRIPTOR.services_by_name["ModelWorkerService"], servicer)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        # A plain channel: gRPC's default 4 MiB receive limit, as any client of the worker has.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            return await asyncio.wait_for(body(worker_pb2_grpc.ModelWorkerServiceStub(channel)), WAIT_S)
    finally:
        await server.stop(None)


async def steps_or_error(request) -> list | grpc.aio.AioRpcError:
    try:
        return [step async for step in request]
    except grpc.aio.AioRpcError as e:
        return e


def test_a_long_prompts_logprobs_and_a_neighbour_share_one_generate_many_call_and_both_finish_whole():
    scores = prompt_scores(POSITIONS)
    engine = ScriptedEngine({
        "big": StepOutput("big", 5, None, [], None, prompt_tokens=POSITIONS, prompt_logprobs=scores),
        "small": StepOutput("small", 9, None, [], None, prompt_tokens=3)})

    async def body(stub):
        mux = WorkerMux(stub.GenerateMany, "w")
        big = mux.open(worker_pb2.GenerateRequest(request_id="big", prompt_token_ids=[1] * POSITIONS,
                                                  prompt_logprobs=CANDIDATES), None)
        small = mux.open(worker_pb2.GenerateRequest(request_id="small", prompt_token_ids=[1, 2, 3]), None)
        return await asyncio.gather(steps_or_error(big), steps_or_error(small))

    big, small = asyncio.run(with_worker(engine, body))
    assert not isinstance(big, grpc.aio.AioRpcError), big
    assert not isinstance(small, grpc.aio.AioRpcError), small
    # One message per token, as for a short prompt: the pieces came joined onto the first.
    assert [s.token_id for s in big] == [5, 2] and [s.token_id for s in small] == [9, 2]
    assert big[0].prompt_tokens == POSITIONS
    assert as_scores(big[0].prompt_logprobs) == scores
    assert list(big[1].prompt_logprobs) == []


def test_an_output_that_cannot_fit_fails_its_own_request_and_the_call_goes_on():
    # A limit below one scored position: no cut can make the first output fit.
    limit = 200
    engine = ScriptedEngine({
        "big": StepOutput("big", 5, None, [], None, prompt_tokens=3, prompt_logprobs=prompt_scores(3)),
        "small": StepOutput("small", 9, None, [], None, prompt_tokens=3)})

    async def body(stub):
        mux = WorkerMux(stub.GenerateMany, "w")
        big = mux.open(worker_pb2.GenerateRequest(request_id="big", prompt_token_ids=[1, 2, 3],
                                                  prompt_logprobs=CANDIDATES), None)
        small = mux.open(worker_pb2.GenerateRequest(request_id="small", prompt_token_ids=[1, 2, 3]), None)
        return await asyncio.gather(steps_or_error(big), steps_or_error(small))

    big, small = asyncio.run(with_worker(engine, body, max_message_bytes=limit))
    assert [s.token_id for s in small] == [9, 2]
    assert isinstance(big, grpc.aio.AioRpcError) and big.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-message-bytes" in big.details()
    assert engine.aborted == ["big"]


def test_a_start_too_large_for_the_worker_fails_alone_before_it_reaches_the_call():
    engine = ScriptedEngine({"small": StepOutput("small", 9, None, [], None, prompt_tokens=3)})

    async def body(stub):
        mux = WorkerMux(stub.GenerateMany, "w")  # the default limit, the worker's too
        # Over 4 MiB on the wire: the worker's gRPC would end the whole call for it.
        huge = mux.open(worker_pb2.GenerateRequest(request_id="huge", prompt_token_ids=[151_000] * 1_500_000), None)
        small = mux.open(worker_pb2.GenerateRequest(request_id="small", prompt_token_ids=[1, 2, 3]), None)
        return await asyncio.gather(steps_or_error(huge), steps_or_error(small))

    huge, small = asyncio.run(with_worker(engine, body))
    assert [s.token_id for s in small] == [9, 2]
    assert isinstance(huge, grpc.aio.AioRpcError) and huge.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-message-bytes" in huge.details()


def test_a_long_prompts_logprob_pieces_and_a_neighbour_share_one_decode_batches_call(demo_tokenizer):
    id_bytes = {rank: token for token, rank in load_ranks(ranks_path()).items()}  # rank = id in Qwen's vocabulary
    rng = random.Random(3)
    words = ["Party", " 🦜🤗", " 中文分词", " then", " more", " 日本語のテキスト", " words", "."]
    text = "".join(rng.choice(words) for _ in range(20_000))
    prompt = demo_tokenizer.encode(text)
    assert len(prompt) >= 30_000  # where the pieces used to pass 4 MiB
    piece_ids = [i for token in prompt for i in (token, *rng.sample(range(100_000), CANDIDATES))]
    neighbour = demo_tokenizer.encode("Emoji 🎉🚀 and 日本語 mixed")

    async def body(stub):
        detokenizer = Detokenizer(stub)

        async def long_prompt():
            return await detokenizer.open(False).add(prompt, True, piece_ids)

        async def token_by_token():
            stream, deltas = detokenizer.open(True), []
            for i, token in enumerate(neighbour):
                deltas.append((await stream.add([token], i == len(neighbour) - 1, [token]))[0])
            return "".join(deltas)

        try:
            return await asyncio.wait_for(asyncio.gather(long_prompt(), token_by_token()), WAIT_S)
        finally:
            await detokenizer.close()

    (decoded, pieces), short = asyncio.run(with_server(demo_tokenizer, body))
    assert decoded == text
    assert pieces == [id_bytes[i] for i in piece_ids]
    assert short == "Emoji 🎉🚀 and 日本語 mixed"


class ScoringWorkerStream:
    """A worker stream whose first step carries prompt logprobs for every prompt position, as the joined
    steps of a worker call give them to the generation core."""

    def __init__(self, work: worker_pb2.GenerateRequest):
        self.work = work

    def __aiter__(self):
        return self._steps()

    async def batches(self):
        async for step in self._steps():
            yield [step]

    async def _steps(self):
        first = worker_pb2.GenerateResponse(token_id=11, prompt_tokens=len(self.work.prompt_token_ids))
        for entry in prompt_scores(len(self.work.prompt_token_ids)):
            scored = first.prompt_logprobs.add()
            if entry is not None:
                scored.logprob = entry[0]
                scored.top.extend(worker_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in entry[1])
        yield first
        yield worker_pb2.GenerateResponse(token_id=12, finish_reason=worker_pb2.FINISH_REASON_LENGTH)

    def cancel(self) -> bool:
        return True


def test_the_public_stream_carries_a_long_prompts_logprobs_in_pieces_a_default_client_reads(demo_tokenizer):
    from tests.unit.test_generation_core import FakeDownstreams
    from tests.unit.test_tool_calls_api import generate
    from vllm_v0.gateway.v1 import gateway_pb2

    text = " ".join(["Party 🦜🤗 中文分词 then more words."] * 2_000)
    prompt = demo_tokenizer.encode(text)
    assert len(prompt) >= 20_000  # some 4.6 MB of prompt logprobs in one message, were it not cut
    downstreams = FakeDownstreams(demo_tokenizer, [])
    downstreams.worker_info = worker_pb2.GetInfoResponse(model="fake", max_context=65_536, max_logprobs=20)
    downstreams.open_worker_stream = lambda work, timeout: ScoringWorkerStream(work)

    # The client keeps gRPC's default 4 MiB receive limit.
    request = gateway_pb2.GenerateRequest(prompt=text, max_tokens=2, prompt_logprobs=CANDIDATES, request_id="long")
    replies = generate(downstreams, request, timeout=WAIT_S)
    assert len(replies) > 4  # pieces, then the two tokens' messages
    assert replies[0].request_id == "long" and replies[-1].request_id == "long"
    assert [t for r in replies for t in r.token_ids] == [11, 12]
    entries = [e for r in replies for e in r.prompt_logprobs]
    assert [e.token_id for e in entries] == prompt
    assert as_scores(entries) == prompt_scores(len(prompt))
    starts = [r.prompt_logprobs_offset for r in replies if r.prompt_logprobs]
    assert starts == sorted(starts) and starts[0] == 0
