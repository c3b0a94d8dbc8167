"""The engine core's wire format: frames and payloads survive the trip, and bad frames are refused."""
from __future__ import annotations

import asyncio
import io
import json
import threading

import pytest

from rpcserver.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.engine import SchedulerLimits
from services.model_worker.config.engine import SpeculativeConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.core import protocol as ipc
from services.model_worker.engine.llm_engine import StepOutput
from services.model_worker.engine.sequence import FinishReason


def test_frames_round_trip_blocking_and_async():
    messages = [{"type": "add", "id": "7", "prompt": [1, 2, 3]}, {"type": "update", "stats": {"中文": -float("inf")}}]
    data = b"".join(ipc.encode(m) for m in messages)
    stream = io.BytesIO(data)
    assert [ipc.read_blocking(stream), ipc.read_blocking(stream), ipc.read_blocking(stream)] == [*messages, None]

    async def read_all():
        reader = asyncio.StreamReader()
        reader.feed_data(data + ipc.encode(messages[0])[:5])  # a frame cut short: its writer is gone
        reader.feed_eof()
        return [await ipc.read_async(reader) for _ in range(3)]
    assert asyncio.run(read_all()) == [*messages, None]


def test_a_large_frame_is_decoded_off_the_event_loop_in_order(monkeypatch):
    """A long prompt's logprobs make a frame of megabytes: its JSON is read on a thread, not the loop."""
    threads = []
    decode = ipc._decode

    def recording(body):
        threads.append(threading.current_thread())
        return decode(body)

    monkeypatch.setattr(ipc, "_decode", recording)
    large = {"type": "update", "scores": [[i, -0.5] for i in range(ipc.OFF_LOOP_FRAME_BYTES // 8)]}
    small = {"type": "abort", "id": "1"}
    assert len(ipc.encode(large)) > ipc.OFF_LOOP_FRAME_BYTES > len(ipc.encode(small))

    async def read_all():
        reader = asyncio.StreamReader()
        reader.feed_data(ipc.encode(large) + ipc.encode(small))
        reader.feed_eof()
        return [await ipc.read_async(reader) for _ in range(2)]

    assert asyncio.run(read_all()) == [large, small]
    assert threads[0] is not threading.main_thread() and threads[1] is threading.main_thread()


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"no": "type"}'])
def test_a_frame_that_is_not_a_typed_json_object_is_refused(body):
    with pytest.raises(ipc.ProtocolError):
        ipc.read_blocking(io.BytesIO(len(body).to_bytes(4, "big") + body))


def test_a_frame_cut_short_is_refused_by_the_core_reader():
    frame = ipc.encode({"type": "abort", "id": "1"})
    with pytest.raises(ipc.ProtocolError):
        ipc.read_blocking(io.BytesIO(frame[:-1]))


def test_payloads_round_trip():
    config = EngineConfig(device="cpu", dtype="float32", num_blocks=12, max_model_len=None,
                          limits=SchedulerLimits(3, 64, 5))
    assert EngineConfig.from_dict(config.to_dict()) == config
    config.speculative = SpeculativeConfig("ngram", num_speculative_tokens=3, ngram_min=1, fixed_k=True)
    assert EngineConfig.from_dict(config.to_dict()) == config
    params = SamplingParams(temperature=0.7, top_k=5, seed=2**64 - 1, logprobs=2, max_tokens=9,
                            stop_token_ids=(4, 5), ignore_eos=True)
    assert ipc.params_from_dict(ipc.params_to_dict(params)) == params
    for output in (StepOutput("3", 17, -0.25, [(17, -0.25), (2, -1.5)], FinishReason.LENGTH, 6),
                   StepOutput("4", 0, None, [], None, 1), StepOutput("5", 3, None, [], None, 2, spec_accepted=2)):
        assert ipc.output_from_list(ipc.output_to_list(output)) == output
    # A token with nothing but its id goes as three values; anything more, and every field goes.
    assert ipc.output_to_list(StepOutput("6", 9, None, [], None, 4)) == ["6", 9, 4]
    for output in (StepOutput("7", 9, -0.5, [], None, 4), StepOutput("8", 9, None, [(9, -0.1)], None, 4),
                   StepOutput("9", 9, None, [], FinishReason.EOS, 4), StepOutput("a", 9, None, [], None, 4, [None]),
                   StepOutput("b", 9, None, [], None, 4, spec_accepted=0)):
        raw = ipc.output_to_list(output)
        assert len(raw) == 8
        assert ipc.output_from_list(json.loads(json.dumps(raw))) == output
    for error in (InvalidArgument("bad prompt"), ResourceExhausted("full"), Unavailable("gone")):
        request_id, back = ipc.error_from_list(ipc.error_to_list("9", error))
        assert request_id == "9" and type(back) is type(error) and str(back) == str(error)
