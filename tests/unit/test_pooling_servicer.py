"""Embed and Score through the worker's servicer on a real grpc.aio server on port 0, over a real engine core:
values against transformers' Qwen3 on the same random checkpoint, refusals with their codes, cancellation and a
core that dies under a call."""
from __future__ import annotations

import asyncio
import json
import os
import signal

import grpc
import pytest
import torch
import torch.nn.functional as F

from rpcserver.handlers import add_servicer
from services.model_worker.core.client import EngineClient
from services.model_worker.server.servicer import ModelWorkerServicer
from tests.checkpoints import TINY, make_checkpoint
from tests.unit.test_batching import greedy, make_engine
from tests.unit.test_engine_client import START_S, WAIT_S, core_config, eventually
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

VOCAB, HIDDEN, CONTEXT = TINY["vocab_size"], TINY["hidden_size"], TINY["max_position_embeddings"]
INPUTS = [[12, 7, 300, 41, 5], [9] * 23, list(range(100, 140)), [3]]
YES_NO = [17, 301]
MAX_WAITING = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-pooling-servicer")
    return make_checkpoint(path, eos_token_id=()), path


def inputs(prompts: list[list[int]]) -> list[worker_pb2.TokenIds]:
    return [worker_pb2.TokenIds(token_ids=p) for p in prompts]


def embed(prompts, **extra) -> worker_pb2.EmbedRequest:
    return worker_pb2.EmbedRequest(request_id="e", inputs=inputs(prompts), **extra)


def score(prompts, token_ids=YES_NO, **extra) -> worker_pb2.ScoreRequest:
    return worker_pb2.ScoreRequest(request_id="s", inputs=inputs(prompts), token_ids=token_ids, **extra)


def serve(path, scenario, **client_kwargs):
    """A client over a fresh core, a servicer on a real server; returns scenario(stub, client)."""
    async def main():
        client = EngineClient(path, core_config(max_waiting=MAX_WAITING), **client_kwargs)
        await asyncio.wait_for(client.start(), START_S)
        server = grpc.aio.server()
        add_servicer(server, worker_pb2.DESCRIPTOR.services_by_name["ModelWorkerService"],
                     ModelWorkerServicer("tiny", client))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await scenario(worker_pb2_grpc.ModelWorkerServiceStub(channel), client)
        finally:
            await server.stop(None)
            await client.close()
    return asyncio.run(main())


async def refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    return refused.value.code(), refused.value.details()


@torch.no_grad()
def test_embed_and_score_match_reference_and_refuse_bad_calls(pair):
    reference, path = pair
    generating = [4, 8, 15, 16, 23, 42]
    alone = make_engine(path).generate([generating], greedy(20))[0]

    async def scenario(stub, client: EngineClient):
        info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=WAIT_S)
        stream = stub.Generate(worker_pb2.GenerateRequest(
            request_id="g", prompt_token_ids=generating, max_tokens=20, ignore_eos=True,
            sampling=worker_pb2.SamplingParams(temperature=0.0)), timeout=WAIT_S)
        tokens = asyncio.ensure_future(_tokens(stream))
        full, cut, scored = await asyncio.gather(
            stub.Embed(embed(INPUTS), timeout=WAIT_S), stub.Embed(embed(INPUTS, dimensions=16), timeout=WAIT_S),
            stub.Score(score(INPUTS), timeout=WAIT_S))
        refusals = {
            "no inputs": await refusal(stub.Embed(embed([]), timeout=WAIT_S)),
            "empty input": await refusal(stub.Embed(embed([[1], []]), timeout=WAIT_S)),
            "outside the vocabulary": await refusal(stub.Embed(embed([[1, VOCAB]]), timeout=WAIT_S)),
            "context": await refusal(stub.Score(score([[1] * (CONTEXT + 1)]), timeout=WAIT_S)),
            "dimensions 0": await refusal(stub.Embed(embed([[1]], dimensions=0), timeout=WAIT_S)),
            "dimensions over": await refusal(stub.Embed(embed([[1]], dimensions=HIDDEN + 1), timeout=WAIT_S)),
            "no token ids": await refusal(stub.Score(score([[1]], token_ids=[]), timeout=WAIT_S)),
            "token id out": await refusal(stub.Score(score([[1]], token_ids=[1, VOCAB]), timeout=WAIT_S)),
            "adapter": await refusal(stub.Embed(embed([[1]], adapter="nope"), timeout=WAIT_S)),
        }
        # A call counts as one request against the queue, however many inputs it has.
        many = await stub.Embed(embed([[i + 1, 2 * i] for i in range(2 * MAX_WAITING)]), timeout=WAIT_S)
        generated = await tokens
        # A full queue: refused at once, before anything reaches the core (an idle core sends no frame to replace
        # these stats meanwhile).
        client.stats = {**client.stats, "waiting": MAX_WAITING}
        full_queue = await refusal(stub.Score(score([[1], [2]]), timeout=WAIT_S))
        client.stats = {**client.stats, "waiting": 0}
        return info, full, cut, scored, refusals, full_queue, generated, many

    info, full, cut, scored, refusals, full_queue, tokens, many = serve(path, scenario)
    assert len(many.embeddings) == 2 * MAX_WAITING and many.prompt_tokens == 4 * MAX_WAITING
    assert info.hidden_size == HIDDEN and not info.embeddings_only and info.runner == "auto"
    assert tokens == alone
    assert full.prompt_tokens == cut.prompt_tokens == scored.prompt_tokens == sum(map(len, INPUTS))
    for prompt, whole, short, logits in zip(INPUTS, full.embeddings, cut.embeddings, scored.results):
        hidden = reference.model(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1]
        for got, want in ((whole.values, F.normalize(hidden, dim=0)), (short.values, F.normalize(hidden[:16], dim=0))):
            assert len(got) == len(want)
            assert F.cosine_similarity(torch.tensor(got), want, dim=0).item() >= 0.99999
        want = reference(input_ids=torch.tensor([prompt])).logits[0, -1, YES_NO]
        got = torch.tensor(logits.logits)
        assert (got - want).abs().max().item() <= 1e-4
        assert abs(torch.sigmoid(got[0] - got[1]) - torch.sigmoid(want[0] - want[1])).item() <= 1e-5
    for name, (code, details) in refusals.items():
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, details)
    assert "inputs[1] is empty" in refusals["empty input"][1]
    assert "LoRA adapters are not enabled" in refusals["adapter"][1]
    assert full_queue[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


@torch.no_grad()
def test_a_checkpoint_without_head_embeds_and_refuses_generating_and_scoring(tmp_path):
    """A bare decoder saved untied and headless (Qwen3-Embedding-4B and -8B): Embed gives transformers' vectors;
    Generate and Score, which need logits, fail FAILED_PRECONDITION at once; GetInfo says so."""
    reference = make_checkpoint(tmp_path / "whole", seed=5, eos_token_id=(), tie_word_embeddings=False)
    path = tmp_path / "bare"
    reference.model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))

    async def scenario(stub, client: EngineClient):
        info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=WAIT_S)
        embedded = await stub.Embed(embed(INPUTS), timeout=WAIT_S)
        generate = await refusal(_tokens(stub.Generate(worker_pb2.GenerateRequest(
            request_id="g", prompt_token_ids=[1, 2, 3], max_tokens=2), timeout=WAIT_S)))
        scored = await refusal(stub.Score(score(INPUTS), timeout=WAIT_S))
        return info, embedded, generate, scored

    info, embedded, generate, scored = serve(path, scenario)
    assert info.embeddings_only
    for code, details in (generate, scored):
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "no lm_head" in details
    for prompt, got in zip(INPUTS, embedded.embeddings):
        want = F.normalize(reference.model(input_ids=torch.tensor([prompt])).last_hidden_state[0, -1], dim=0)
        assert F.cosine_similarity(torch.tensor(got.values), want, dim=0).item() >= 0.99999


async def _tokens(stream) -> list[int]:
    return [m.token_id async for m in stream]


def test_cancelled_call_drops_its_inputs_and_a_dead_core_fails_calls(pair):
    _, path = pair
    long_inputs = [[(i * 7 + j) % VOCAB for j in range(400)] for i in range(8)]

    async def scenario(stub, client: EngineClient):
        core = client.process
        steps = client.stats["steps"]
        os.kill(core.pid, signal.SIGSTOP)  # the inputs wait in the socket while the call is cancelled
        try:
            call = stub.Embed(embed(long_inputs), timeout=WAIT_S)
            assert await eventually(lambda: len(client._pooling) == len(long_inputs))
            call.cancel()
            assert await eventually(lambda: len(client._pooling) == 0)
        finally:
            os.kill(core.pid, signal.SIGCONT)
        assert await eventually(lambda: client.stats["adds_applied"] == len(long_inputs)
                                and client.stats["running"] == client.stats["waiting"] == 0)
        # 3,200 tokens at 512 a step would take 7 steps: the aborts came with the adds.
        cancelled_steps = client.stats["steps"] - steps

        os.kill(core.pid, signal.SIGSTOP)
        call = stub.Score(score(long_inputs), timeout=WAIT_S)
        assert await eventually(lambda: len(client._pooling) == len(long_inputs))
        os.kill(core.pid, signal.SIGKILL)
        died = await refusal(call)
        assert await eventually(lambda: not client.serving)
        down = await refusal(stub.Embed(embed([[1, 2]]), timeout=WAIT_S))
        assert await eventually(lambda: client.serving, START_S)
        again = await stub.Embed(embed([[1, 2]]), timeout=WAIT_S)
        return cancelled_steps, died, down, again

    cancelled_steps, died, down, again = serve(path, scenario, restart_delay_s=(0.1, 0.1))
    assert cancelled_steps <= 3
    assert died[0] == grpc.StatusCode.UNAVAILABLE and "SIGKILL" in died[1]
    assert down[0] == grpc.StatusCode.UNAVAILABLE
    assert len(again.embeddings) == 1 and len(again.embeddings[0].values) == HIDDEN
