"""A gateway on two tokenizer processes: the one carrying its text streams is killed mid-stream, and every
stream still ends whole with exactly the text of an unbroken run, and new requests still encode."""
from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from tokenizers import Tokenizer

from tests.integration.stack import Service, free_port, wait_serving
from tests.integration.test_metrics import scrape, value
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc

PROMPTS = ["The quick brown fox", "中文分词 and emoji 🎉", "日本語のテキスト", "Once upon a time", "🦜🤗 party",
           "A list of numbers: 1, 2,"]
NEW_TOKENS = 160  # a few seconds of generation for all of them together: in flight when the tokenizer dies


@pytest.fixture()
def services(checkpoint, tmp_path):
    """Two tokenizers (with metrics, to see which one carries DecodeBatches), a worker, and a gateway on them."""
    tokenizers = [Service(f"tokenizer-{i}", ["services.tokenizer", "--model", str(checkpoint), "--metrics-port",
                                             str(free_port())], free_port(), str(tmp_path / f"tokenizer-{i}.log"))
                  for i in range(2)]
    worker = Service("worker", ["services.model_worker", "--model", str(checkpoint), "--dtype", "float32",
                                "--max-waiting", "64"], free_port(), str(tmp_path / "worker.log"))
    gateway = Service("gateway", ["gateway", "--tokenizer-addr", ",".join(t.address for t in tokenizers),
                                  "--worker-addr", worker.address, "--health-interval", "0.2",
                                  "--metrics-port", str(free_port())], free_port(), str(tmp_path / "gateway.log"))
    everything = [*tokenizers, worker, gateway]
    try:
        for service in everything:
            service.start()
        for service in everything:
            wait_serving(service.address, timeout=120)
        yield tokenizers, gateway
    finally:
        for service in reversed(everything):
            service.stop()


def metrics_port(service: Service) -> int:
    return int(service.args[service.args.index("--metrics-port") + 1])


def request(prompt: str, max_tokens: int = NEW_TOKENS) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)


def drain(call, first=()) -> tuple[list[int], str]:
    """A stream's ids and text, read to its end; it must end OK with a finish reason."""
    messages = [*first, *call]
    assert messages and messages[-1].finish_reason
    return [i for m in messages for i in m.token_ids], "".join(m.text for m in messages)


def test_killing_the_tokenizer_carrying_the_streams_leaves_every_stream_whole(services, checkpoint):
    tokenizers, gateway_service = services
    reference = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    with grpc.insecure_channel(gateway_service.address) as channel:
        gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            unbroken = list(pool.map(lambda p: drain(gateway.Generate(request(p), timeout=60)), PROMPTS))
        for ids, text in unbroken:
            assert len(ids) == NEW_TOKENS and text == reference.decode(ids, skip_special_tokens=True)

        calls = [gateway.Generate(request(p), timeout=60) for p in PROMPTS]
        firsts = [next(call) for call in calls]  # every stream is under way
        carrying = [t for t in tokenizers
                    if value(scrape(metrics_port(t)), "grpc_server_started_total", grpc_method="DecodeBatches")]
        assert len(carrying) == 1, "one DecodeBatches call carries the gateway's text"
        carrying[0].stop(signal.SIGKILL)
        with ThreadPoolExecutor(len(calls)) as pool:
            broken = list(pool.map(drain, calls, [[f] for f in firsts]))
        assert broken == unbroken

        # New requests encode on the tokenizer left; the gateway still serves.
        wait_serving(gateway_service.address, timeout=5)
        for prompt in PROMPTS[:3]:
            ids, text = drain(gateway.Generate(request(prompt, 4), timeout=30))
            assert ids == unbroken[PROMPTS.index(prompt)][0][:4]

    deadline = time.monotonic() + 5
    while not (resumed := value(scrape(metrics_port(gateway_service)), "vllm_v0_gateway_resumes_total",
                                cause="tokenizer")) and time.monotonic() < deadline:
        time.sleep(0.1)
    # Each stream was re-primed on a new call once, unless it had already ended when the tokenizer died.
    assert 1 <= resumed <= len(PROMPTS)
    assert "a new call on tokenizer" in gateway_service.log()
