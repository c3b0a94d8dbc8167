"""The gateway's generation core in-process, over fake downstreams (no sockets): text, stops, logprobs, cancels."""
from __future__ import annotations

import asyncio
import unicodedata
from types import SimpleNamespace

import grpc
import pytest

from demo.vocab import load_ranks, ranks_path
from gateway.core.generation import GenerationCore
from gateway.core.metrics import RequestRecord
from gateway.core.validation import GenerationRequest
from gateway.text.detokenize import Detokenizer
from rpcserver.errors import InvalidArgument, ServiceError, Unavailable
from rpcserver.status import status_for
from services.tokenizer.decode_batches import DecodeBatchState
from services.tokenizer.decode_stream import TokenPieces
from vllm_v0.tokenizer.v1 import tokenizer_pb2
from vllm_v0.worker.v1 import worker_pb2

IM_END = 151645


class FakeBatchCall:
    """DecodeBatches as the servicer answers it, on the real tokenizer core, without a channel."""

    def __init__(self, core):
        self.core, self.pieces, self.state = core, TokenPieces(core), DecodeBatchState(core)
        self.requests: list[tokenizer_pb2.DecodeBatchRequest] = []
        self.replies: asyncio.Queue = asyncio.Queue()
        self.closed: list[int] = []  # stream ids of close items
        self.cancelled = False

    async def write(self, request: tokenizer_pb2.DecodeBatchRequest) -> None:
        assert not self.cancelled
        self.requests.append(request)
        results = []
        for item in request.items:
            if item.close:
                self.closed.append(item.stream_id)
                self.state.close(item.stream_id, list(item.token_ids), list(item.piece_ids))
                continue
            try:
                self.core.check_ids(list(item.piece_ids))
                text = self.state.add(item.stream_id, list(item.token_ids), item.final, item.skip_special_tokens)
            except ServiceError as e:  # as the service answers a bad item: that stream alone fails
                self.state.forget(item.stream_id)
                results.append(tokenizer_pb2.DecodeBatchResult(
                    stream_id=item.stream_id, error_code=status_for(e).value[0], error_message=str(e)))
                continue
            results.append(tokenizer_pb2.DecodeBatchResult(
                stream_id=item.stream_id, text=text, pieces=[self.pieces(i) for i in item.piece_ids]))
        self.replies.put_nowait(tokenizer_pb2.DecodeBatchResponse(results=results))

    async def read(self):
        return await self.replies.get()

    async def code(self):
        return grpc.StatusCode.CANCELLED if self.cancelled else grpc.StatusCode.OK

    async def details(self):
        return ""

    def cancel(self) -> bool:
        self.cancelled = True
        return True

    @property
    def sent_items(self) -> list[tokenizer_pb2.DecodeBatchItem]:
        return [item for request in self.requests for item in request.items]


class FakeTokenizer:
    def __init__(self, core):
        self.core = core
        self.calls: list[FakeBatchCall] = []

    async def Encode(self, request, timeout=None):
        # Chat is rendered as the plain concatenation of its contents: enough to count tokens.
        text = request.text or "".join(m.content for m in request.messages)
        return tokenizer_pb2.EncodeResponse(token_ids=self.core.encode(text))

    def DecodeBatches(self, timeout=None):
        assert timeout is None  # the shared call has no deadline: each request's own bounds it upstream
        self.calls.append(FakeBatchCall(self.core))
        return self.calls[-1]


class FakeWorkerStream:
    """Streams a scripted list of ids, one per step, the last with `finish`; records a cancel."""

    def __init__(self, ids: list[int], finish, top: int | None):
        self.ids, self.finish, self.top = ids, finish, top
        self.cancelled = False
        self.sent = 0

    def __aiter__(self):
        return self._steps()

    async def batches(self):
        """A step a batch: a reader that keeps up with the worker."""
        async for step in self._steps():
            yield [step]

    async def _steps(self):
        for i, token_id in enumerate(self.ids):
            step = worker_pb2.GenerateResponse(token_id=token_id)
            if self.top is not None:
                step.logprob = -0.5 - i
                step.top_logprobs.extend(worker_pb2.TokenLogprob(token_id=token_id + k, logprob=-1.0 - k)
                                         for k in range(self.top))
            if i == len(self.ids) - 1 and self.finish is not None:
                step.finish_reason = self.finish
            self.sent += 1
            yield step
            await asyncio.sleep(0)

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeDownstreams:
    def __init__(self, core, ids, finish=worker_pb2.FINISH_REASON_LENGTH):
        self.tokenizer = FakeTokenizer(core)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.worker_info = worker_pb2.GetInfoResponse(model="fake", max_context=1024)
        self.token_text = {IM_END: "<|im_end|>"}
        self.ids, self.finish = ids, finish
        self.works: list[worker_pb2.GenerateRequest] = []
        self.streams: list[FakeWorkerStream] = []

    def open_worker_stream(self, work, timeout):
        self.works.append(work)
        self.streams.append(FakeWorkerStream(self.ids, self.finish, work.logprobs if work.HasField("logprobs")
                                             else None))
        return self.streams[-1]


async def settle(detokenizer: Detokenizer) -> None:
    """Wait until the items already added (a cancel's close among them) have reached the call."""
    for _ in range(100):
        batch = detokenizer.batch
        if batch is None or not batch.pending:
            return
        await asyncio.sleep(0)
    raise AssertionError("the detokenizer's items never went out")


def run(core: GenerationCore, req: GenerationRequest, with_pieces=False):
    async def collect():
        try:
            return [d async for d in core.generate(req, RequestRecord("r1"), with_pieces=with_pieces)]
        finally:
            await settle(core.downstreams.detokenizer)
    return asyncio.run(collect())


TEXT = "Emoji 🎉🚀 and 日本語 mixed, then more words"


def test_deltas_add_up_to_the_full_decode_and_end_with_usage(demo_tokenizer):
    ids = demo_tokenizer.encode(TEXT)
    downstreams = FakeDownstreams(demo_tokenizer, ids)
    deltas = run(GenerationCore(downstreams, {}), GenerationRequest(prompt="hi", max_tokens=len(ids)))
    assert "".join(d.text for d in deltas) == unicodedata.normalize("NFC", TEXT)
    assert [i for d in deltas for i in d.token_ids] == ids
    # A character cut across byte tokens is held back: some deltas are empty, none shows U+FFFD.
    assert any(d.text == "" for d in deltas) and not any("\ufffd" in d.text for d in deltas)
    last = deltas[-1]
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(ids) - 1)
    assert last.finish_reason == "length" and last.completion_tokens == len(ids)
    assert last.prompt_tokens == len(demo_tokenizer.encode("hi"))
    assert downstreams.works[0].max_tokens == len(ids) and list(downstreams.works[0].prompt_token_ids) == \
        demo_tokenizer.encode("hi")
    assert not downstreams.streams[0].cancelled
    call = downstreams.tokenizer.calls[0]  # its final item ended the stream: no close, nothing left held
    assert call.sent_items[-1].final and call.closed == [] and call.state.streams == {}


def test_the_worker_gets_the_gateways_own_id_and_the_record_keeps_the_callers(demo_tokenizer):
    """Callers may reuse an id, even at once; the worker needs each open request's id to be unique."""
    ids = demo_tokenizer.encode("done")
    downstreams = FakeDownstreams(demo_tokenizer, ids)
    core = GenerationCore(downstreams, {})
    records = [RequestRecord("shared"), RequestRecord("shared")]

    async def both():
        async def one(record):
            return [d async for d in core.generate(GenerationRequest(prompt="hi", request_id="shared"), record)]
        return await asyncio.gather(*(one(r) for r in records))

    for deltas in asyncio.run(both()):
        assert deltas[-1].finish_reason == "length"
    sent = [w.request_id for w in downstreams.works]
    assert len(set(sent)) == 2 and "shared" not in sent
    assert [r.worker_request_id for r in records] == sent
    assert [r.request_id for r in records] == ["shared", "shared"]


def test_stop_string_cuts_the_text_and_cancels_the_worker(demo_tokenizer):
    ids = demo_tokenizer.encode(TEXT)
    downstreams = FakeDownstreams(demo_tokenizer, ids)
    deltas = run(GenerationCore(downstreams, {}),
                 GenerationRequest(prompt="hi", max_tokens=len(ids), stop=["日本", "zzz"]))
    assert "".join(d.text for d in deltas) == "Emoji 🎉🚀 and "
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "日本"
    assert downstreams.streams[0].cancelled and downstreams.streams[0].sent < len(ids)
    call = downstreams.tokenizer.calls[0]
    assert call.closed == [call.sent_items[0].stream_id] and call.state.streams == {}


def test_eos_names_the_token_and_special_tokens_are_skipped(demo_tokenizer):
    ids = [*demo_tokenizer.encode("done"), IM_END]
    downstreams = FakeDownstreams(demo_tokenizer, ids, finish=worker_pb2.FINISH_REASON_EOS)
    deltas = run(GenerationCore(downstreams, {}), GenerationRequest(prompt="hi"))
    assert "".join(d.text for d in deltas) == "done"
    assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == ("eos", "<|im_end|>")


def test_logprob_pieces_are_the_vocabulary_bytes(demo_tokenizer):
    # The reference is the BPE rank file itself: rank = id, and its key is the token's bytes.
    id_bytes = {rank: token for token, rank in load_ranks(ranks_path()).items()}
    ids = demo_tokenizer.encode(TEXT)
    downstreams = FakeDownstreams(demo_tokenizer, ids)
    deltas = run(GenerationCore(downstreams, {}), GenerationRequest(prompt="hi", logprobs=2), with_pieces=True)
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert [lp.chosen.token_id for lp in logprobs] == ids
    assert [lp.chosen.piece for lp in logprobs] == [id_bytes[i] for i in ids]
    assert b"".join(lp.chosen.piece for lp in logprobs) == TEXT.encode()
    assert all([t.piece for t in lp.top] == [id_bytes[lp.chosen.token_id + k] for k in range(2)] for lp in logprobs)
    assert logprobs[3].chosen.logprob == pytest.approx(-3.5)


def test_bad_request_fails_before_any_downstream_call(demo_tokenizer):
    downstreams = FakeDownstreams(demo_tokenizer, [1, 2])
    with pytest.raises(InvalidArgument, match="temperature"):
        run(GenerationCore(downstreams, {}), GenerationRequest(prompt="hi", temperature=-1.0))
    with pytest.raises(InvalidArgument, match="context"):
        run(GenerationCore(downstreams, {}), GenerationRequest(prompt="hi", max_tokens=1024))
    assert downstreams.works == [] and downstreams.tokenizer.calls == []


def test_worker_stream_without_finish_is_unavailable_and_cancelled(demo_tokenizer):
    downstreams = FakeDownstreams(demo_tokenizer, demo_tokenizer.encode("cut short"), finish=None)
    with pytest.raises(Unavailable, match="without a finish reason"):
        run(GenerationCore(downstreams, {}), GenerationRequest(prompt="hi"))
    assert downstreams.streams[0].cancelled
    call = downstreams.tokenizer.calls[0]
    assert call.closed == [call.sent_items[0].stream_id] and call.state.streams == {}


def test_leaving_early_cancels_the_worker(demo_tokenizer):
    downstreams = FakeDownstreams(demo_tokenizer, demo_tokenizer.encode(TEXT))

    async def first_two():
        generation = GenerationCore(downstreams, {}).generate(GenerationRequest(prompt="hi"), RequestRecord("r"))
        got = [await anext(generation), await anext(generation)]
        await generation.aclose()  # what a client's disconnect does
        await settle(downstreams.detokenizer)
        return got

    assert len(asyncio.run(first_two())) == 2
    assert downstreams.streams[0].cancelled
    call = downstreams.tokenizer.calls[0]
    assert call.closed == [call.sent_items[0].stream_id] and call.state.streams == {}


def test_no_worker_info_is_unavailable(demo_tokenizer):
    downstreams = FakeDownstreams(demo_tokenizer, [1])
    downstreams.worker_info = None
    with pytest.raises(Unavailable):
        run(GenerationCore(downstreams, {}), GenerationRequest(prompt="hi"))


class CountingIds(list):
    """Prompt ids that count how often they are read whole (copied into a list, iterated)."""
    reads = 0

    def __iter__(self):
        CountingIds.reads += 1
        return super().__iter__()


def test_an_over_long_prompt_is_refused_by_its_length_before_its_ids_are_copied(demo_tokenizer):
    """The Encode reply of a long prompt holds hundreds of thousands of ids: refused by len(), not read whole
    on the event loop (once for each of its choices)."""
    downstreams = FakeDownstreams(demo_tokenizer, [])

    async def encode(request, timeout=None):
        return SimpleNamespace(token_ids=CountingIds(range(5000)), rendered="")

    downstreams.tokenizer.Encode = encode
    CountingIds.reads = 0
    with pytest.raises(InvalidArgument, match="5000 tokens"):
        run(GenerationCore(downstreams, {}), GenerationRequest(prompt="long", max_tokens=1))
    assert CountingIds.reads == 0
