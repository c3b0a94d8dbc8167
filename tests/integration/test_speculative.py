"""Speculative decoding through the services: a worker with --speculative-method ngram streams transformers' greedy
tokens one message each, and reports its proposals in GetInfo, /metrics and the gateway's request log."""
from __future__ import annotations

import grpc
import pytest

from tests.integration.stack import free_port, make_stack
from tests.integration.test_metrics import scrape, value
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc


@pytest.fixture(scope="module")
def spec_stack(checkpoint, tmp_path_factory):
    port = free_port()
    stack = make_stack(str(checkpoint), str(tmp_path_factory.mktemp("speculative-logs")),
                       worker_flags=["--speculative-method", "ngram", "--ngram-min", "1", "--metrics-port", str(port)])
    stack.start()
    stack.worker_metrics_port = port
    yield stack
    stack.stop()


def test_greedy_tokens_equal_the_reference_one_message_each(spec_stack, reference):
    greedy, tokenizer = reference
    with grpc.insecure_channel(spec_stack.worker.address) as channel:
        worker = worker_pb2_grpc.ModelWorkerServiceStub(channel)
        for text in ("Once upon a time", "1, 2, 3, 4"):
            seed = tokenizer.encode(text)
            # The model's own continuation in the prompt: its next tokens repeat spans of it, which get proposed.
            prompt = seed + greedy(seed, 24)
            want = greedy(prompt, 20)
            greedy_params = worker_pb2.SamplingParams(temperature=0)
            messages = list(worker.Generate(worker_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=20,
                                                                       sampling=greedy_params)))
            assert [m.token_id for m in messages] == want
        info = worker.GetInfo(worker_pb2.GetInfoRequest())
    assert info.speculative_method == "ngram"
    assert 0 < info.speculative_accepted_tokens <= info.speculative_proposed_tokens
    assert info.speculative_acceptance_rate == pytest.approx(
        info.speculative_accepted_tokens / info.speculative_proposed_tokens)
    samples = scrape(spec_stack.worker_metrics_port)
    assert value(samples, "vllm_v0_worker_spec_proposed_tokens_total", method="ngram") == \
        info.speculative_proposed_tokens
    assert value(samples, "vllm_v0_worker_spec_accepted_tokens_total", method="ngram") == \
        info.speculative_accepted_tokens


def test_the_gateway_logs_the_mean_accepted_length(spec_stack, reference):
    greedy, tokenizer = reference
    seed = tokenizer.encode("Once upon a time")
    prompt = tokenizer.decode(seed + greedy(seed, 24))
    with grpc.insecure_channel(spec_stack.gateway.address) as channel:
        gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
        list(gateway.Generate(gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=16, temperature=0,
                                                          request_id="spec-log-1")))
    line = next(line for line in spec_stack.gateway.log().splitlines() if "request spec-log-1:" in line)
    assert "speculative: mean accepted length" in line
