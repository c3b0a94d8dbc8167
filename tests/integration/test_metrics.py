"""Each service's /metrics moves as requests go through, and the gateway logs one line per request."""
from __future__ import annotations

import re
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.stack import Service, free_port, make_stack, wait_serving
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc

SECRET = "zebra-quartz-sentinel"  # appears in every prompt and must appear in no log by default
# Long enough to fill whole 16-token KV blocks, so the second request reuses the first's prefix.
LONG_PROMPT = f"{SECRET} " + "the quick brown fox jumps over the lazy dog " * 6
PROMPTS = [LONG_PROMPT, LONG_PROMPT, f"{SECRET} a short one"]
MAX_TOKENS = [5, 7, 3]


@pytest.fixture(scope="module")
def metrics_stack(checkpoint, tmp_path_factory):
    ports = {name: free_port() for name in ("tokenizer", "worker", "gateway")}
    stack = make_stack(str(checkpoint), str(tmp_path_factory.mktemp("metrics-logs")),
                       tokenizer_flags=["--metrics-port", str(ports["tokenizer"])],
                       worker_flags=["--metrics-port", str(ports["worker"])],
                       gateway_flags=["--metrics-port", str(ports["gateway"])])
    stack.start()
    stack.metrics_ports = ports
    yield stack
    stack.stop()


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Every sample on http://127.0.0.1:port/metrics, keyed by (name, labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    """Sum of the samples called `name` whose labels include `labels` (0 when there are none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def handled(samples, service: str, method: str, code: str | None = None) -> float:
    labels = dict(grpc_service=service, grpc_method=method)
    if code:
        labels["grpc_code"] = code
    return value(samples, "grpc_server_handled_total", **labels)


def eventually(read, check, timeout: float = 5.0):
    """The servers count a call as it completes, which a client may see a moment earlier."""
    deadline = time.monotonic() + timeout
    while True:
        samples = read()
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def test_metrics_and_request_log(metrics_stack):
    ports = metrics_stack.metrics_ports
    completion, prompt_tokens = [], []
    with grpc.insecure_channel(metrics_stack.gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for i, (prompt, max_tokens) in enumerate(zip(PROMPTS, MAX_TOKENS)):
            last = list(stub.Generate(gateway_pb2.GenerateRequest(
                prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, request_id=f"good-{i}")))[-1]
            completion.append(last.usage.completion_tokens)
            prompt_tokens.append(last.usage.prompt_tokens)
        with pytest.raises(grpc.RpcError) as bad:
            list(stub.Generate(gateway_pb2.GenerateRequest(prompt=SECRET, temperature=-1, request_id="bad-0")))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert completion == MAX_TOKENS

    gateway_service, worker_service = "vllm_v0.gateway.v1.GatewayService", "vllm_v0.worker.v1.ModelWorkerService"
    gw = eventually(lambda: scrape(ports["gateway"]),
                    lambda s: handled(s, gateway_service, "Generate") == len(PROMPTS) + 1)
    assert handled(gw, gateway_service, "Generate", "OK") == len(PROMPTS)
    assert handled(gw, gateway_service, "Generate", "INVALID_ARGUMENT") == 1
    assert value(gw, "grpc_server_started_total", grpc_method="Generate") == len(PROMPTS) + 1
    assert value(gw, "vllm_v0_gateway_completion_tokens_total") == sum(completion)
    assert value(gw, "vllm_v0_gateway_prompt_tokens_total") == sum(prompt_tokens)
    assert value(gw, "vllm_v0_gateway_time_to_first_token_seconds_count") == len(PROMPTS)
    assert value(gw, "vllm_v0_gateway_time_per_output_token_seconds_count") == len(PROMPTS)  # all made > 1 token
    assert value(gw, "vllm_v0_gateway_requests_finished_total", finish_reason="length") == len(PROMPTS)
    assert value(gw, "vllm_v0_gateway_requests_finished_total", finish_reason="error") == 1

    worker = scrape(ports["worker"])
    # Every request reached the worker exactly once, on the gateway's shared GenerateMany call(s).
    assert value(worker, "vllm_v0_worker_requests_total", rpc="GenerateMany") == len(PROMPTS)
    assert value(worker, "vllm_v0_worker_requests_total", rpc="Generate") == 0
    assert value(worker, "grpc_server_started_total", grpc_service=worker_service, grpc_method="GenerateMany") >= 1
    assert value(worker, "vllm_v0_worker_generated_tokens_total") == sum(completion)
    assert value(worker, "vllm_v0_worker_step_duration_seconds_count") >= max(completion)
    assert value(worker, "vllm_v0_worker_running_sequences") == 0
    assert value(worker, "vllm_v0_worker_waiting_requests") == 0
    assert value(worker, "vllm_v0_worker_kv_blocks_total") > 0
    assert value(worker, "vllm_v0_worker_prefix_cache_hit_tokens_total") >= 16  # the repeated long prompt
    queried = value(worker, "vllm_v0_worker_prefix_cache_queried_tokens_total")
    assert value(worker, "vllm_v0_worker_prefix_cache_hit_ratio") == pytest.approx(
        value(worker, "vllm_v0_worker_prefix_cache_hit_tokens_total") / queried)

    tokenizer = scrape(ports["tokenizer"])
    assert handled(tokenizer, "vllm_v0.tokenizer.v1.TokenizerService", "Encode", "OK") == len(PROMPTS)

    log = metrics_stack.gateway.log()
    for request_id, code in [*((f"good-{i}", "OK") for i in range(len(PROMPTS))), ("bad-0", "INVALID_ARGUMENT")]:
        lines = [line for line in log.splitlines() if re.search(rf"request {request_id}: ", line)]
        assert len(lines) == 1, (request_id, lines)
        assert f"request {request_id}: {code}," in lines[0]
    assert SECRET not in log


def test_log_prompts_adds_the_prompt(metrics_stack, tmp_path):
    stack = metrics_stack
    gateway = Service("gateway-log-prompts", ["gateway", "--tokenizer-addr", stack.tokenizer.address,
                                              "--worker-addr", stack.worker.address, "--log-prompts"],
                      free_port(), str(tmp_path / "gateway.log"))
    gateway.start()
    try:
        wait_serving(gateway.address, timeout=30)
        with grpc.insecure_channel(gateway.address) as channel:
            list(gateway_pb2_grpc.GatewayServiceStub(channel).Generate(gateway_pb2.GenerateRequest(
                prompt=f"{SECRET}\nsecond line", max_tokens=2, request_id="logged-0")))
    finally:
        gateway.stop()
    lines = [line for line in gateway.log().splitlines() if "request logged-0: OK," in line]
    assert len(lines) == 1
    assert f"prompt text '{SECRET}\\nsecond line'" in lines[0]  # repr keeps the request on one line
