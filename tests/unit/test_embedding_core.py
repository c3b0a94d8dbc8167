"""The embedding core over fake downstreams: prompts, encodes, checks, worker calls in message-sized pieces,
retries on another worker, and the Sentence Transformers pipelines it refuses."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.core.embedding import EmbeddingCore, EmbeddingRequest
from gateway.core.prompt_runs import MAX_INPUTS, PoolingRecord
from rpcserver.errors import InvalidArgument, Unavailable
from tests.unit.pooling_fakes import (
    HIDDEN_SIZE,
    QUERY_PROMPT,
    FakeWorker,
    assert_rows_close,
    fake_downstreams,
    raw_vector,
    rpc_error,
    tokenizer_info,
    unit,
)


def embed(downstreams, req: EmbeddingRequest, **kwargs):
    record = PoolingRecord("embed", "r1")
    result = asyncio.run(EmbeddingCore(downstreams, {}).embed(req, record, **kwargs))
    return result, record


def test_texts_take_the_named_prompt_and_ids_go_as_they_are(demo_tokenizer):
    downstreams = fake_downstreams(demo_tokenizer)
    ids = demo_tokenizer.encode("already tokenized")
    result, record = embed(downstreams, EmbeddingRequest(["what is BM25?", ids, "what is BM25?"], prompt_name="query"))
    prompted = demo_tokenizer.encode(QUERY_PROMPT + "what is BM25?")
    sent = [list(i.token_ids) for r in downstreams.fleet.workers["w1"].stub.requests for i in r.inputs]
    assert sent == [prompted, ids, prompted]
    assert_rows_close(result.vectors, [unit(raw_vector(i)) for i in sent])
    assert result.prompt_tokens == record.prompt_tokens == 2 * len(prompted) + len(ids) and record.inputs == 3
    # One Encode per distinct text, with the tokenizer's special tokens as Sentence Transformers encodes.
    assert [(r.text, r.add_special_tokens) for r in downstreams.tokenizer.requests] == [
        (QUERY_PROMPT + "what is BM25?", True)]


def test_the_default_prompt_applies_unless_another_is_named(demo_tokenizer):
    info = tokenizer_info({"query": QUERY_PROMPT, "document": ""}, default="query")
    downstreams = fake_downstreams(demo_tokenizer, info=info)
    embed(downstreams, EmbeddingRequest(["a", "b"]))
    embed(downstreams, EmbeddingRequest(["c"], prompt_name="document"))
    assert [r.text for r in downstreams.tokenizer.requests] == [QUERY_PROMPT + "a", QUERY_PROMPT + "b", "c"]
    assert downstreams.tokenizer.most_running == 2  # the distinct texts are encoded at once


def test_dimensions_and_the_adapter_reach_the_worker(demo_tokenizer):
    downstreams = fake_downstreams(demo_tokenizer)
    result, _ = embed(downstreams, EmbeddingRequest(["x"], dimensions=4, adapter="sql"))
    work = downstreams.fleet.workers["w1"].stub.requests[0]
    assert work.dimensions == 4 and work.adapter == "sql" and downstreams.fleet.picks == [("w1", "sql")]
    assert len(result.vectors[0]) == 4
    assert sum(v * v for v in result.vectors[0]) == pytest.approx(1.0, abs=1e-6)
    assert not work.request_id.startswith("r1")  # the gateway's own id, never the caller's


@pytest.mark.parametrize("req, says", [
    (EmbeddingRequest([]), "inputs is empty"),
    (EmbeddingRequest(["a", ""]), "inputs[1] is empty"),
    (EmbeddingRequest([[]]), "inputs[0] is empty"),
    (EmbeddingRequest(["a"] * (MAX_INPUTS + 1)), f"at most {MAX_INPUTS}"),
    (EmbeddingRequest(["a"], dimensions=0), "dimensions must be at least 1"),
    (EmbeddingRequest(["a"], dimensions=HIDDEN_SIZE + 1), f"dimensions must be in [1, {HIDDEN_SIZE}]"),
    (EmbeddingRequest([list(range(65))]), "inputs[0] is 65 tokens; at most 64"),
    (EmbeddingRequest([[5, 151936]]), "inputs[0][1] is 151936, not a token id"),
    (EmbeddingRequest([[5, -1]], inputs_name="input"), "input[0][1] is -1, not a token id"),
    (EmbeddingRequest(["a"], prompt_name="passage"), "prompt_name 'passage' is not a prompt"),
    (EmbeddingRequest(["a"], request_id="bad id"), "request_id has ' '"),
])
def test_refusals_name_what_is_wrong_and_reach_no_worker(demo_tokenizer, req, says):
    downstreams = fake_downstreams(demo_tokenizer)
    with pytest.raises(InvalidArgument) as refused:
        embed(downstreams, req)
    assert says in str(refused.value)
    assert downstreams.fleet.workers["w1"].stub.requests == []


def test_an_input_longer_than_the_context_after_its_prompt_is_refused(demo_tokenizer):
    downstreams = fake_downstreams(demo_tokenizer, max_context=20)
    text = "word " * 10
    assert len(demo_tokenizer.encode(text)) <= 20 < len(demo_tokenizer.encode(QUERY_PROMPT + text))
    embed(downstreams, EmbeddingRequest([text]))
    with pytest.raises(InvalidArgument, match=r"inputs\[0\] is \d+ tokens; at most 20"):
        embed(downstreams, EmbeddingRequest([text], prompt_name="query"))


@pytest.mark.parametrize("modules, pooling, says", [
    (["sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling"], ["mean"],
     "pools by mean"),
    (["sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling"], ["cls", "lasttoken"],
     r"pools by cls \+ lasttoken"),
    (["sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
      "sentence_transformers.models.Dense", "sentence_transformers.models.Normalize"], ["lasttoken"],
     "has sentence_transformers.models.Dense"),
])
def test_a_pipeline_beyond_last_token_pooling_is_refused_by_name(demo_tokenizer, modules, pooling, says):
    downstreams = fake_downstreams(demo_tokenizer, info=tokenizer_info(modules=modules, pooling=pooling))
    with pytest.raises(InvalidArgument, match=says):
        embed(downstreams, EmbeddingRequest(["a"]))


def test_qwen3_embeddings_pipeline_is_served(demo_tokenizer):
    modules = ["sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
               "sentence_transformers.models.Normalize"]
    downstreams = fake_downstreams(demo_tokenizer, info=tokenizer_info(modules=modules, pooling=["lasttoken"]))
    result, _ = embed(downstreams, EmbeddingRequest(["a"]))
    assert len(result.vectors) == 1


def test_no_worker_yet_is_unavailable(demo_tokenizer):
    downstreams = fake_downstreams(demo_tokenizer)
    downstreams.worker_info = None
    with pytest.raises(Unavailable):
        embed(downstreams, EmbeddingRequest(["a"]))


def test_many_inputs_go_in_calls_within_the_message_limit_in_order(demo_tokenizer):
    downstreams = fake_downstreams(demo_tokenizer, max_message_bytes=1000)
    inputs = [[i + 1] * 9 for i in range(40)]
    result, _ = embed(downstreams, EmbeddingRequest(inputs))
    requests = downstreams.fleet.workers["w1"].stub.requests
    assert len(requests) > 1 and all(r.ByteSize() <= 500 for r in requests)
    assert [list(i.token_ids) for r in requests for i in r.inputs] == inputs
    assert len({r.request_id for r in requests}) == len(requests)
    assert_rows_close(result.vectors, [unit(raw_vector(i)) for i in inputs])


def test_an_unavailable_worker_is_left_for_another(demo_tokenizer):
    down = FakeWorker("w1", [rpc_error(grpc.StatusCode.UNAVAILABLE, "draining")])
    downstreams = fake_downstreams(demo_tokenizer, [down, FakeWorker("w2")])
    result, _ = embed(downstreams, EmbeddingRequest(["a"]))
    assert [a for a, _ in downstreams.fleet.picks] == ["w1", "w2"] and len(result.vectors) == 1
    first, again = down.stub.requests[0], downstreams.fleet.workers["w2"].stub.requests[0]
    assert again.request_id == first.request_id + ".1"  # the failed attempt may still be on w1
    assert down.in_flight == 0 and downstreams.fleet.workers["w2"].in_flight == 0


def test_retries_stop_at_max_resumes_and_other_statuses_pass_at_once(demo_tokenizer):
    unavailable = [rpc_error(grpc.StatusCode.UNAVAILABLE)] * 3
    downstreams = fake_downstreams(demo_tokenizer, [FakeWorker("w1", unavailable)], max_resumes=2)
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        embed(downstreams, EmbeddingRequest(["a"]))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(downstreams.fleet.workers["w1"].stub.requests) == 3

    full = FakeWorker("w1", [rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")])
    downstreams = fake_downstreams(demo_tokenizer, [full, FakeWorker("w2")])
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        embed(downstreams, EmbeddingRequest(["a"]))
    assert failed.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert downstreams.fleet.workers["w2"].stub.requests == []


def test_a_reply_too_large_for_one_message_is_refused_before_any_work(demo_tokenizer):
    downstreams = fake_downstreams(demo_tokenizer)
    with pytest.raises(InvalidArgument, match="fewer inputs"):
        embed(downstreams, EmbeddingRequest(["a"] * 100), max_reply_bytes=100 * 4 * HIDDEN_SIZE)
    assert downstreams.tokenizer.requests == []
    embed(downstreams, EmbeddingRequest(["a"] * 100, dimensions=4), max_reply_bytes=100 * 4 * HIDDEN_SIZE)
