"""The real services across processes, driven as a client would, against transformers' greedy output."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.integration.stack import ROOT
from tests.penalties import penalised_greedy
from vllm_v0.gateway.v1 import gateway_pb2
from vllm_v0.worker.v1 import worker_pb2

PROMPTS = ["The capital of France is", "你好，世界！今天天气", "Emoji time 🎉🚀 and 👩‍👩‍👧", "日本語のテキスト 😀 mixed"]


def collect(stream) -> tuple[str, list[int], gateway_pb2.GenerateResponse]:
    text, ids, last = "", [], None
    for message in stream:
        text += message.text
        ids += message.token_ids
        last = message
    return text, ids, last


def expected(reference, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], str]:
    greedy, tokenizer = reference
    ids = greedy(prompt_ids, max_tokens)
    return ids, tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_text_equals_reference_greedy(gateway, reference, prompt):
    _, tokenizer = reference
    prompt_ids = tokenizer.encode(prompt)
    want_ids, want_text = expected(reference, prompt_ids, 24)
    text, ids, last = collect(gateway.Generate(gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=24,
                                                                           temperature=0)))
    assert ids == want_ids
    assert text == want_text
    assert last.usage.prompt_tokens == len(prompt_ids)
    assert last.usage.completion_tokens == len(want_ids)
    # The reference stops at eos, so fewer tokens than asked means the worker saw eos too.
    want_finish = gateway_pb2.FINISH_REASON_LENGTH if len(want_ids) == 24 else gateway_pb2.FINISH_REASON_EOS
    assert last.finish_reason == want_finish
    assert last.time_to_first_token_s > 0


def test_concatenated_deltas_equal_decode_of_all_ids(gateway, reference):
    # Sampling over the whole vocabulary produces characters split across tokens (and byte
    # sequences that are not UTF-8 at all); the deltas must still add up to the full decode.
    _, tokenizer = reference
    for seed in range(3):
        text, ids, _ = collect(gateway.Generate(gateway_pb2.GenerateRequest(
            prompt="🎉 你好", max_tokens=40, seed=seed, temperature=1.0, top_k=0, top_p=1.0)))
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


def test_chat_messages(gateway, reference):
    greedy, tokenizer = reference
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi in 中文"}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False,
                                               tokenize=True, return_dict=False)
    want_ids = greedy(list(prompt_ids), 16)
    request = gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        enable_thinking=False, max_tokens=16, temperature=0)
    text, ids, last = collect(gateway.Generate(request))
    assert ids == want_ids
    assert text == tokenizer.decode(want_ids, skip_special_tokens=True)
    assert last.usage.prompt_tokens == len(prompt_ids)


def test_stop_string_ends_generation_and_is_not_emitted(gateway, reference):
    _, tokenizer = reference
    prompt = PROMPTS[0]
    _, full = expected(reference, tokenizer.encode(prompt), 24)
    assert len(full) > 12
    stop = full[8:11]
    want = full[:full.index(stop)]
    text, _, last = collect(gateway.Generate(gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=24, temperature=0,
                                                                         stop=[stop])))
    assert text == want
    assert last.finish_reason == gateway_pb2.FINISH_REASON_STOP
    assert last.stop_reason == stop


def test_penalties_through_the_services(gateway, reference, reference_model):
    _, tokenizer = reference
    prompt = "The capital of France is the capital of France"
    prompt_ids = tokenizer.encode(prompt)
    with torch.no_grad():
        want = reference_model.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False,
                                        repetition_penalty=1.3, eos_token_id=None,
                                        pad_token_id=151643)[0, len(prompt_ids):].tolist()
    _, ids, _ = collect(gateway.Generate(gateway_pb2.GenerateRequest(
        prompt=prompt, max_tokens=16, temperature=0, repetition_penalty=1.3, ignore_eos=True)))
    assert ids == want
    want = penalised_greedy(reference_model, prompt_ids, 48, presence=2.0, frequency=2.0)
    _, ids, _ = collect(gateway.Generate(gateway_pb2.GenerateRequest(
        prompt=prompt, max_tokens=48, temperature=0, presence_penalty=2.0, frequency_penalty=2.0, ignore_eos=True)))
    assert ids == want
    plain = collect(gateway.Generate(gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=48, temperature=0,
                                                                 ignore_eos=True)))[1]
    assert ids != plain  # the penalties changed the output, so skipping them would show


def test_max_tokens_gives_finish_reason_length(gateway):
    text, ids, last = collect(gateway.Generate(gateway_pb2.GenerateRequest(prompt="count", max_tokens=5,
                                                                           ignore_eos=True)))
    assert len(ids) == 5
    assert last.finish_reason == gateway_pb2.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 5


def test_concurrent_streams_each_get_their_own_output(gateway, reference):
    _, tokenizer = reference
    prompts = [f"{p} #{i}" for i, p in enumerate(PROMPTS * 2)]
    wants = [expected(reference, tokenizer.encode(p), 12 + i) for i, p in enumerate(prompts)]

    def run(i: int):
        return collect(gateway.Generate(gateway_pb2.GenerateRequest(prompt=prompts[i], max_tokens=12 + i,
                                                                    temperature=0)))
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    for (text, ids, _), (want_ids, want_text) in zip(results, wants):
        assert ids == want_ids
        assert text == want_text


def wait_idle(worker, timeout: float = 5.0) -> worker_pb2.GetInfoResponse:
    deadline = time.monotonic() + timeout
    while True:
        info = worker.GetInfo(worker_pb2.GetInfoRequest())
        if (info.running == 0 and info.waiting == 0 and info.kv_blocks_used == 0) or time.monotonic() > deadline:
            return info


def test_cancelled_client_leaves_no_sequence_in_the_worker(gateway, worker):
    calls = [gateway.Generate(gateway_pb2.GenerateRequest(prompt=f"long story {i}", max_tokens=500, ignore_eos=True))
             for i in range(4)]
    for call in calls:
        next(call)  # streaming has started
    busy = worker.GetInfo(worker_pb2.GetInfoRequest())
    assert busy.running + busy.waiting > 0 and busy.kv_blocks_used > 0
    for call in calls:
        call.cancel()
    info = wait_idle(worker)
    assert (info.running, info.waiting, info.kv_blocks_used) == (0, 0, 0)


@pytest.mark.parametrize("fields, fragment", [
    # On the wire an empty prompt and an empty message list are the same message: the answer names both.
    (dict(prompt=""), "neither prompt nor messages is given"),
    (dict(messages=[]), "neither prompt nor messages is given"),
    (dict(prompt="hi", temperature=-1), "temperature"),
    (dict(prompt="hi", top_p=0), "top_p"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", top_k=-2), "top_k"),
    (dict(prompt="hi", stop=["x"] * 100), "stop"),
    (dict(prompt="hi", stop=["y" * 10_000]), "stop"),
    (dict(prompt="hi", max_tokens=10**6), "max_tokens"),
    (dict(prompt="word " * 2000), "prompt is 2001 tokens"),
    (dict(prompt="word " * 600, max_tokens=600), "max_tokens must be in [1, 423] for this prompt of 601 tokens"),
    (dict(messages=[gateway_pb2.ChatMessage(role="wizard", content="hi")]), "role"),
])
def test_bad_requests_are_invalid_argument_and_service_keeps_serving(gateway, fields, fragment):
    with pytest.raises(grpc.RpcError) as error:
        collect(gateway.Generate(gateway_pb2.GenerateRequest(**fields)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in error.value.details()
    _, ids, _ = collect(gateway.Generate(gateway_pb2.GenerateRequest(prompt="still fine", max_tokens=2)))
    assert len(ids) == 2


def test_worker_rejects_out_of_vocabulary_ids(worker):
    with pytest.raises(grpc.RpcError) as error:
        list(worker.Generate(worker_pb2.GenerateRequest(prompt_token_ids=[1, 10**9], max_tokens=2)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_worker_streams_one_token_per_message(worker):
    messages = list(worker.Generate(worker_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], max_tokens=6,
                                                               ignore_eos=True, logprobs=3)))
    assert len(messages) == 6
    assert messages[0].prompt_tokens == 3
    assert all(m.finish_reason == worker_pb2.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    assert messages[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
    for m in messages:
        assert len(m.top_logprobs) == 3 and m.logprob <= 0


def services_via_reflection(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        return {s.name for reply in replies for s in reply.list_services_response.service}


def test_reflection_and_health_on_every_server(stack):
    wanted = {"gateway": "vllm_v0.gateway.v1.GatewayService", "tokenizer": "vllm_v0.tokenizer.v1.TokenizerService",
              "worker": "vllm_v0.worker.v1.ModelWorkerService"}
    for service in stack.services:
        names = services_via_reflection(service.address)
        assert wanted[service.name] in names and "grpc.health.v1.Health" in names
        with grpc.insecure_channel(service.address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_client_cli_streams_and_summarises(stack):
    result = subprocess.run([sys.executable, "-m", "gateway.client", "--addr", stack.gateway.address,
                             "Hello", "--max-tokens", "4", "--temperature", "0", "--ignore-eos"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    # --ignore-eos: exactly 4 tokens, so the finish reason is length whatever the random model samples.
    summary = result.stderr.splitlines()
    assert "finish_reason: length" in summary and "completion_tokens: 4" in summary


def test_grpcurl_examples_from_the_readme(stack):
    """The README's grpcurl commands, run as written (reflection only, no .proto files)."""
    import json
    import shutil

    grpcurl = shutil.which("grpcurl") or str(pathlib.Path(sys.executable).parent / "grpcurl")
    address = stack.gateway.address

    def run(*args: str) -> str:
        result = subprocess.run([grpcurl, "-plaintext", *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert "vllm_v0.gateway.v1.GatewayService" in run(address, "list")
    assert "rpc Generate" in run(address, "describe", "vllm_v0.gateway.v1.GatewayService")
    body = json.dumps({"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    out = run("-d", body, address, "vllm_v0.gateway.v1.GatewayService/Generate")
    messages = [json.loads(m) for m in out.replace("}\n{", "}\x00{").split("\x00")]
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    assert messages[-1]["usage"]["completion_tokens"] == 4
    body = json.dumps({"prompt": "Hello there", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1,
                       "logit_bias": {"9707": 100}})
    out = run("-d", body, address, "vllm_v0.gateway.v1.GatewayService/Generate")
    messages = [json.loads(m) for m in out.replace("}\n{", "}\x00{").split("\x00")]
    scored = messages[0]["prompt_logprobs"]
    assert len(scored) == 2 and "logprob" not in scored[0] and len(scored[1]["top"]) == 1
    assert [t for m in messages for t in m.get("token_ids", [])] == [9707, 9707]
