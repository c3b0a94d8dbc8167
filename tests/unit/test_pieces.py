"""Large payloads cut into messages under a byte budget and joined back: prompt logprobs and DecodeBatches results."""
from __future__ import annotations

import random

import pytest

from gateway.grpc_api.servicer import in_pieces
from rpcserver.pieces import (GRPC_MESSAGE_BYTES, MAX_PIECE_BYTES, PromptLogprobsJoiner, piece_budget, runs,
                              split_prompt_logprobs)
from services.tokenizer.decode_batches import reply_messages
from vllm_v0.gateway.v1 import gateway_pb2
from vllm_v0.tokenizer.v1 import tokenizer_pb2
from vllm_v0.worker.v1 import worker_pb2

POSITIONS, CANDIDATES = 40_000, 20  # a long prompt scored with the most alternatives a request may ask for


def scored_prompt(pb2, positions: int = POSITIONS, seed: int = 0) -> list:
    """Random prompt logprobs in `pb2`'s PromptLogprob shape (the gateway's has the token id too)."""
    rng = random.Random(seed)
    entries = []
    for position in range(positions):
        entry = pb2.PromptLogprob(top=[pb2.TokenLogprob(token_id=rng.randrange(151_936), logprob=-rng.random() * 20)
                                       for _ in range(CANDIDATES)])
        if position:
            entry.logprob = -rng.random() * 20
        if pb2 is gateway_pb2:
            entry.token_id = rng.randrange(151_936)
        entries.append(entry)
    return entries


def joined(messages):
    """The last message with the entries of every piece before its own."""
    joiner = PromptLogprobsJoiner()
    for message in messages[:-1]:
        joiner.add(message)
    return joiner.complete(messages[-1])


def test_forty_thousand_positions_go_out_as_pieces_under_the_budget_and_join_back():
    whole = worker_pb2.GenerateResponse(token_id=7, logprob=-0.5, prompt_tokens=POSITIONS,
                                        prompt_logprobs=scored_prompt(worker_pb2))
    original = worker_pb2.GenerateResponse()
    original.CopyFrom(whole)
    assert original.ByteSize() > GRPC_MESSAGE_BYTES  # what used to end the shared call

    budget = piece_budget(GRPC_MESSAGE_BYTES)
    messages = split_prompt_logprobs(whole, budget, lambda: worker_pb2.GenerateResponse(prompt_logprobs_only=True))
    assert len(messages) > GRPC_MESSAGE_BYTES // budget
    assert all(m.ByteSize() <= budget for m in messages)
    assert all(m.prompt_logprobs_only for m in messages[:-1]) and not messages[-1].prompt_logprobs_only
    # Each piece starts where the ones before it end.
    starts = [m.prompt_logprobs_offset for m in messages]
    assert starts == [sum(len(m.prompt_logprobs) for m in messages[:i]) for i in range(len(messages))]
    # The token's message keeps its token; joined, the entries are the original ones.
    last = messages[-1]
    assert (last.token_id, last.logprob, last.prompt_tokens) == (7, -0.5, POSITIONS)
    whole = joined(messages)
    assert list(whole.prompt_logprobs) == list(original.prompt_logprobs)
    assert whole.prompt_logprobs_offset == 0 and whole == original


def test_a_message_within_the_budget_is_left_as_it_is():
    message = worker_pb2.GenerateResponse(token_id=3, prompt_logprobs=scored_prompt(worker_pb2, positions=50))
    assert split_prompt_logprobs(message, piece_budget(GRPC_MESSAGE_BYTES), worker_pb2.GenerateResponse) == [message]
    assert message.prompt_logprobs_offset == 0


def test_a_missing_or_repeated_piece_is_an_error_not_shifted_logprobs():
    whole = worker_pb2.GenerateResponse(prompt_logprobs=scored_prompt(worker_pb2, positions=3000))
    messages = split_prompt_logprobs(whole, 64 << 10, lambda: worker_pb2.GenerateResponse(prompt_logprobs_only=True))
    assert len(messages) >= 3
    with pytest.raises(ValueError, match="missing or repeated"):
        joined([messages[0], *messages[2:]])
    with pytest.raises(ValueError, match="missing or repeated"):
        joined([messages[0], messages[0], *messages[1:]])
    with pytest.raises(ValueError, match="missing or repeated"):
        joined(messages[1:])  # the leading pieces never came


def test_the_public_reply_is_cut_the_same_way_and_its_first_piece_names_the_request():
    reply = gateway_pb2.GenerateResponse(text="Hi", token_ids=[9], request_id="req-1",
                                         prompt_logprobs=scored_prompt(gateway_pb2, positions=20_000, seed=1))
    original = gateway_pb2.GenerateResponse()
    original.CopyFrom(reply)
    budget = piece_budget(GRPC_MESSAGE_BYTES)
    replies = in_pieces(reply, budget)
    assert len(replies) > 2 and all(r.ByteSize() <= budget for r in replies)
    assert [r.request_id for r in replies] == ["req-1"] + [""] * (len(replies) - 2) + ["req-1"]
    # A client that predates pieces and collects text and ids from every message still gets them whole.
    assert "".join(r.text for r in replies) == "Hi" and [t for r in replies for t in r.token_ids] == [9]
    assert [e for r in replies for e in r.prompt_logprobs] == list(original.prompt_logprobs)
    assert list(joined(replies).prompt_logprobs) == list(original.prompt_logprobs)


@pytest.mark.parametrize("seed", range(5))
def test_runs_cover_every_element_in_order_within_the_budget(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([1, 5, 40, 300]) for _ in range(rng.randrange(0, 400))]
    budget = 299
    cut = list(runs(sizes, budget))
    assert [i for run in cut for i in run] == list(range(len(sizes)))
    for run in cut:
        assert sum(sizes[i] for i in run) <= budget or len(run) == 1  # only a lone oversized element passes


def test_the_budget_follows_a_small_limit_and_stays_well_under_the_default():
    assert piece_budget(GRPC_MESSAGE_BYTES) == MAX_PIECE_BYTES <= GRPC_MESSAGE_BYTES // 4
    assert piece_budget(64 << 10) == 32 << 10
    assert piece_budget(64 << 20) == MAX_PIECE_BYTES


def test_a_large_decode_result_is_cut_into_replies_under_the_budget_and_joins_back():
    rng = random.Random(2)
    # A long prompt's text, with characters of 1 to 4 UTF-8 bytes so cuts fall inside some of them,
    # and the raw bytes of its 21 candidates a position.
    text = "".join(rng.choice(["a", "é", "中", "🦜"]) for _ in range(400_000))
    pieces = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 12))) for _ in range(POSITIONS * 21)]
    big = tokenizer_pb2.DecodeBatchResult(stream_id=1, text=text, pieces=pieces)
    small = tokenizer_pb2.DecodeBatchResult(stream_id=2, text="next")
    assert big.ByteSize() > GRPC_MESSAGE_BYTES

    replies = list(reply_messages([small, big, small], GRPC_MESSAGE_BYTES))
    budget = piece_budget(GRPC_MESSAGE_BYTES)
    assert len(replies) > 4 and all(r.ByteSize() <= budget for r in replies)
    results = [r for reply in replies for r in reply.results]
    # Joined at each `more`, the results are the three that went in.
    whole, parts = [], []
    for result in results:
        parts.append(result)
        if not result.more:
            whole.append((parts[0].stream_id, "".join(p.text for p in parts), [x for p in parts for x in p.pieces]))
            assert {p.stream_id for p in parts} == {parts[0].stream_id}
            parts = []
    assert parts == []
    assert whole == [(2, "next", []), (1, text, pieces), (2, "next", [])]


def test_a_request_of_closes_alone_still_gets_its_reply():
    assert list(reply_messages([], GRPC_MESSAGE_BYTES)) == [tokenizer_pb2.DecodeBatchResponse()]
