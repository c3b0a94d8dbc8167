"""The gateway's generation core in-process, over fake downstreams (no sockets): text, stops, logprobs, cancels."""
from __future__ import annotations

import asyncio
import unicodedata

import pytest

from demo.vocab import load_ranks, ranks_path
from gateway.generation import GenerationCore
from gateway.metrics import RequestRecord
from gateway.validation import GenerationRequest
from rpcserver.errors import InvalidArgument, Unavailable
from services.tokenizer.decode_stream import DecodeStreamState, TokenPieces
from vllm_v0.tokenizer.v1 import tokenizer_pb2
from vllm_v0.worker.v1 import worker_pb2

IM_END = 151645


class FakeDecodeCall:
    """DecodeStream as the servicer answers it, on the real tokenizer core, without a channel."""

    def __init__(self, core):
        self.core, self.pieces, self.state = core, TokenPieces(core), None
        self.replies: list = []
        self.cancelled = self.finished = False

    async def write(self, request: tokenizer_pb2.DecodeStreamRequest) -> None:
        assert not self.finished and not self.cancelled
        if self.state is None:
            self.state = DecodeStreamState(self.core, request.skip_special_tokens)
        text = self.state.add(list(request.token_ids), request.final)
        self.replies.append(tokenizer_pb2.DecodeStreamResponse(
            text=text, pieces=[self.pieces(i) for i in request.piece_ids]))

    async def read(self):
        return self.replies.pop(0)

    async def done_writing(self) -> None:
        self.finished = True

    async def code(self):
        return 0

    def cancel(self) -> bool:
        self.cancelled = not self.finished
        return self.cancelled


class FakeTokenizer:
    def __init__(self, core):
        self.core = core
        self.calls: list[FakeDecodeCall] = []

    async def Encode(self, request, timeout=None):
        # Chat is rendered as the plain concatenation of its contents: enough to count tokens.
        text = request.text or "".join(m.content for m in request.messages)
        return tokenizer_pb2.EncodeResponse(token_ids=self.core.encode(text))

    def DecodeStream(self, timeout=None):
        self.calls.append(FakeDecodeCall(self.core))
        return self.calls[-1]


class FakeWorkerStream:
    """Streams a scripted list of ids, one per step, the last with `finish`; records a cancel."""

    def __init__(self, ids: list[int], finish, top: int | None):
        self.ids, self.finish, self.top = ids, finish, top
        self.cancelled = False
        self.sent = 0

    def __aiter__(self):
        return self._steps()

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


def run(core: GenerationCore, req: GenerationRequest, with_pieces=False):
    async def collect():
        return [d async for d in core.generate(req, RequestRecord("r1"), with_pieces=with_pieces)]
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
    assert not downstreams.tokenizer.calls[0].cancelled and downstreams.tokenizer.calls[0].finished


def test_stop_string_cuts_the_text_and_cancels_the_worker(demo_tokenizer):
    ids = demo_tokenizer.encode(TEXT)
    downstreams = FakeDownstreams(demo_tokenizer, ids)
    deltas = run(GenerationCore(downstreams, {}),
                 GenerationRequest(prompt="hi", max_tokens=len(ids), stop=["日本", "zzz"]))
    assert "".join(d.text for d in deltas) == "Emoji 🎉🚀 and "
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "日本"
    assert downstreams.streams[0].cancelled and downstreams.streams[0].sent < len(ids)
    assert downstreams.tokenizer.calls[0].cancelled


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
    assert downstreams.streams[0].cancelled and downstreams.tokenizer.calls[0].cancelled


def test_leaving_early_cancels_the_worker(demo_tokenizer):
    downstreams = FakeDownstreams(demo_tokenizer, demo_tokenizer.encode(TEXT))

    async def first_two():
        generation = GenerationCore(downstreams, {}).generate(GenerationRequest(prompt="hi"), RequestRecord("r"))
        got = [await anext(generation), await anext(generation)]
        await generation.aclose()  # what a client's disconnect does
        return got

    assert len(asyncio.run(first_two())) == 2
    assert downstreams.streams[0].cancelled and downstreams.tokenizer.calls[0].cancelled


def test_no_worker_info_is_unavailable(demo_tokenizer):
    downstreams = FakeDownstreams(demo_tokenizer, [1])
    downstreams.worker_info = None
    with pytest.raises(Unavailable):
        run(GenerationCore(downstreams, {}), GenerationRequest(prompt="hi"))
