"""Several gateway processes on one tokenizer and one worker: each serves whole, exact streams, at the same time.

Where one gateway process is the ceiling, more of them share the downstream services (docs/kubernetes.md,
"Several gateway processes"); nothing is shared between gateways but the tokenizer and the workers.
"""
from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from tokenizers import Tokenizer

from tests.integration.stack import Service, free_port, wait_serving
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning", "Gateways in front of",
           "中文分词 and emoji 🎉", "A list of numbers: 1, 2,"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def second_gateway(stack, tmp_path_factory):
    """A second gateway process on the stack's tokenizer and worker, with an HTTP port of its own."""
    http_port = free_port()
    gateway = Service("gateway-2", ["gateway", "--tokenizer-addr", stack.tokenizer.address, "--worker-addr",
                                    stack.worker.address, "--http-port", str(http_port)], free_port(),
                      str(tmp_path_factory.mktemp("logs") / "gateway-2.log"))
    gateway.start()
    try:
        wait_serving(gateway.address, timeout=60)
    except TimeoutError:
        gateway.stop()
        raise AssertionError(f"the second gateway did not serve:\n{gateway.log()[-3000:]}") from None
    gateway.http_url = f"http://127.0.0.1:{http_port}"
    yield gateway
    assert gateway.stop() == 0


def direct(stack, prompt_ids: list[int]) -> list[int]:
    """The worker's own greedy tokens for a prompt: the reference every gateway must pass on unchanged."""
    with grpc.insecure_channel(stack.worker.address) as channel:
        stub = worker_pb2_grpc.ModelWorkerServiceStub(channel)
        return [m.token_id for m in stub.Generate(worker_pb2.GenerateRequest(
            prompt_token_ids=prompt_ids, max_tokens=NEW_TOKENS, ignore_eos=True,
            sampling=worker_pb2.SamplingParams(temperature=0)), timeout=120)]


def over_grpc(address: str, prompt: str) -> tuple[list[int], str]:
    with grpc.insecure_channel(address) as channel:
        replies = list(gateway_pb2_grpc.GatewayServiceStub(channel).Generate(gateway_pb2.GenerateRequest(
            prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True), timeout=120))
    return [i for r in replies for i in r.token_ids], "".join(r.text for r in replies)


def over_http(url: str, prompt: str) -> str:
    body = json.dumps({"model": "", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        events = [line[6:] for line in reply.read().decode().splitlines() if line.startswith("data: {")]
    return "".join(json.loads(e)["choices"][0]["text"] for e in events)


def test_two_gateway_processes_serve_exact_streams_at_once(stack, second_gateway, checkpoint):
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    want = [direct(stack, ids) for ids in prompt_ids]
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in want]

    gateways = [(stack.gateway.address, stack.http_url), (second_gateway.address, second_gateway.http_url)]
    jobs = [(kind, g, i) for i in range(len(PROMPTS)) for g in range(2) for kind in ("grpc", "http")]
    with ThreadPoolExecutor(len(jobs)) as pool:  # every stream of both gateways in flight together
        results = list(pool.map(lambda job: over_grpc(gateways[job[1]][0], PROMPTS[job[2]]) if job[0] == "grpc"
                                else over_http(gateways[job[1]][1], PROMPTS[job[2]]), jobs))
    for (kind, g, i), got in zip(jobs, results):
        if kind == "grpc":
            assert got == (want[i], texts[i]), (g, PROMPTS[i])
        else:
            assert got == texts[i], (g, PROMPTS[i])
