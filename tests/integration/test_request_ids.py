"""Request ids through the real gateway: callers may share one, each gets its own output; bad ids are refused."""
from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import grpc
import pytest

from vllm_v0.gateway.v1 import gateway_pb2

RULE = "at most 128 printable ASCII characters, without spaces or control characters"


def generate(prompt: str, max_tokens: int, request_id: str) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                       request_id=request_id)


def tokens(replies: list[gateway_pb2.GenerateResponse]) -> list[int]:
    return [t for r in replies for t in r.token_ids]


def post_completion(url: str, request_id: str, max_tokens: int) -> tuple[str, dict]:
    body = json.dumps({"model": "", "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={
        "content-type": "application/json", "x-request-id": request_id})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return reply.headers["x-request-id"], json.loads(reply.read())


def test_two_clients_with_one_id_at_once_both_get_their_whole_output(stack, gateway):
    """Before, the second got INVALID_ARGUMENT ("already generating") for the first client's request."""
    shared = f"shared-{time.monotonic_ns()}"
    alone = {prompt: tokens(list(gateway.Generate(generate(prompt, 16, f"alone-{i}"), timeout=120)))
             for i, prompt in enumerate(("Once upon a time", "The weather today"))}
    first = gateway.Generate(generate("Once upon a time", 400, shared), timeout=120)
    head = next(first)  # the first request is generating on the worker now, with 399 tokens to go
    second = list(gateway.Generate(generate("The weather today", 16, shared), timeout=120))
    echoed, third = post_completion(stack.http_url, shared, 8)  # a third client, over HTTP, with the same id
    first = [head, *first]
    assert first[-1].usage.completion_tokens == 400 and second[-1].usage.completion_tokens == 16
    # Greedy: each begins with the tokens it gets alone, so no output of the other leaked in.
    assert tokens(first)[:16] == alone["Once upon a time"] and tokens(second) == alone["The weather today"]
    for replies in (first, second):
        assert replies[0].request_id == replies[-1].request_id == shared  # the caller's id, echoed
    assert echoed == shared and third["usage"]["completion_tokens"] == 8
    lines = [line for line in stack.gateway.log().splitlines() if f"request {shared}: OK" in line]
    worker_ids = {re.search(r"worker request (\w+)", line).group(1) for line in lines}
    assert len(lines) == 3 and len(worker_ids) == 3 and shared not in worker_ids


@pytest.mark.parametrize("request_id, why", [
    ("forged\nINFO gateway.requests: request x: OK", "'\\n' at position 6"),
    ("x" * 129, "request_id is 129 characters"),
    ("has space", "' ' at position 3"),
])
def test_a_bad_id_is_refused_naming_the_rule_and_never_logged(stack, gateway, request_id, why):
    with pytest.raises(grpc.RpcError) as refused:
        list(gateway.Generate(generate("Hello", 4, request_id), timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert why in refused.value.details() and RULE in refused.value.details()
    time.sleep(0.5)  # the call's log line is written as it ends
    log = stack.gateway.log()
    assert request_id.partition("\n")[0] not in log  # no part of it reached the log
    # The refusal has its log line, under a generated id.
    assert re.search(r"request [0-9a-f]{32}: INVALID_ARGUMENT, .*why .*request_id", log)


def test_a_bad_id_header_is_refused_over_http(stack):
    with pytest.raises(urllib.error.HTTPError) as refused:
        post_completion(stack.http_url, "y" * 129, 4)
    assert refused.value.code == 400
    error = json.loads(refused.value.read())["error"]
    assert error["type"] == "invalid_request_error" and RULE in error["message"]
