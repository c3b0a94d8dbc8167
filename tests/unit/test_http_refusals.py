"""The HTTP front refuses what it can at once, as vLLM does: an unknown model (404), and requests invalid on their
face (400) even while no worker serves, as the core does for gRPC; errors name the field the caller sent."""
from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from gateway.core.generation import GenerationCore
from gateway.core.validation import GenerationRequest
from gateway.main import served_model_name
from gateway.http_api.http_app import create_app
from rpcserver.errors import InvalidArgument, Unavailable
from tests.unit.test_generation_core import TEXT, FakeDownstreams, run
from tests.unit.test_http_app import error_of

SERVED = "Qwen/Qwen3-0.6B"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
PROMPT = {"prompt": "hi", "max_tokens": 4}


def encode_calls(downstreams: FakeDownstreams) -> list:
    """The EncodeRequests the tokenizer gets from now on."""
    calls, encode = [], downstreams.tokenizer.Encode

    async def counted(request, timeout=None):
        calls.append(request)
        return await encode(request, timeout)

    downstreams.tokenizer.Encode = counted
    return calls


def served(demo_tokenizer, model=SERVED, worker=True, overrides=None):
    """(client, downstreams, the Encode calls) of the HTTP front serving `model` over fake downstreams."""
    downstreams = FakeDownstreams(demo_tokenizer, demo_tokenizer.encode(TEXT))
    if not worker:
        downstreams.worker_info = None  # none serving: a worker restarting, or not up yet
    app = create_app(GenerationCore(downstreams, overrides or {}), lambda: model, lambda: worker, None, 1 << 20)
    return TestClient(app), downstreams, encode_calls(downstreams)


@pytest.fixture()
def serve(demo_tokenizer):
    return lambda **options: served(demo_tokenizer, **options)


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", PROMPT)])
def test_an_unknown_model_is_not_found_as_vllm_answers(serve, path, body):
    client, downstreams, encodes = serve()
    error = error_of(client.post(path, json={"model": "gpt-4", **body}), 404)
    assert error == {"message": "The model `gpt-4` does not exist.", "type": "NotFoundError", "param": "model",
                     "code": 404}
    assert downstreams.works == [] and encodes == []
    for model in (SERVED, ""):  # the served name, or none: vLLM takes an empty name for the served model
        assert client.post(path, json={"model": model, **body}).status_code == 200, model
    assert client.post(path, json=body).status_code == 200  # no model field at all


def test_a_model_name_is_checked_once_the_served_one_is_known(serve):
    """No --model-name and no worker has answered: the name cannot be checked, so the request waits for a worker."""
    client, _, _ = serve(model="", worker=False)
    assert error_of(client.post("/v1/completions", json={"model": "gpt-4", **PROMPT}), 503)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {**PROMPT, "top_p": 2}, "top_p"),
    ("/v1/completions", {**PROMPT, "seed": -1}, "seed"),
    ("/v1/completions", {**PROMPT, "prompt": ""}, "prompt"),
    ("/v1/completions", {**PROMPT, "prompt": ["ok", ""]}, "prompt"),
    ("/v1/completions", {**PROMPT, "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {**CHAT, "stop": [""]}, "stop[0]"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required", "response_format": {"type": "json_object"},
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
])
def test_a_request_invalid_on_its_face_gets_400_while_no_worker_serves(serve, path, body, param):
    client, downstreams, encodes = serve(worker=False)
    error = error_of(client.post(path, json={"model": SERVED, **body}), 400)
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert encodes == [] and downstreams.works == []


def test_a_valid_request_waits_for_a_worker(serve):
    client, _, encodes = serve(worker=False)
    error = error_of(client.post("/v1/completions", json={"model": SERVED, **PROMPT}), 503)
    assert error["type"] == "service_unavailable" and encodes == []


def test_the_core_refuses_a_bad_request_before_it_asks_for_a_worker(demo_tokenizer):
    """The gRPC front's path: INVALID_ARGUMENT, not UNAVAILABLE, while no worker serves."""
    downstreams = FakeDownstreams(demo_tokenizer, demo_tokenizer.encode(TEXT))
    downstreams.worker_info = None
    core = GenerationCore(downstreams, {})
    for req in (GenerationRequest(prompt="hi", top_p=2.0), GenerationRequest(prompt=""),
                GenerationRequest(prompt="hi", seed=-1), GenerationRequest(messages=[])):
        with pytest.raises(InvalidArgument):
            run(core, req)
    with pytest.raises(Unavailable):
        run(core, GenerationRequest(prompt="hi"))


def test_one_bad_prompt_of_many_is_refused_before_any_is_encoded(serve):
    client, downstreams, encodes = serve()
    error = error_of(client.post("/v1/completions", json={"model": SERVED, **PROMPT, "prompt": ["a", "b", ""]}), 400)
    assert "empty" in error["message"]
    assert encodes == [] and downstreams.works == []


def test_top_logprobs_out_of_range_names_top_logprobs(serve):
    client, _, _ = serve()
    error = error_of(client.post("/v1/chat/completions", json={
        "model": SERVED, **CHAT, "logprobs": True, "top_logprobs": 50}), 400)
    assert error["param"] == "top_logprobs" and error["message"] == "top_logprobs must be in [0, 20], got 50"


def test_max_completion_tokens_out_of_range_names_max_completion_tokens(serve):
    client, _, _ = serve()
    body = {"model": SERVED, "messages": CHAT["messages"]}
    error = error_of(client.post("/v1/chat/completions", json={**body, "max_completion_tokens": 0}), 400)
    assert error["param"] == "max_completion_tokens", error
    error = error_of(client.post("/v1/chat/completions", json={**body, "max_completion_tokens": 5000}), 400)
    assert error["param"] == "max_completion_tokens" and error["message"].startswith("max_completion_tokens must be")
    error = error_of(client.post("/v1/chat/completions", json={**body, "max_tokens": 5000}), 400)
    assert error["param"] == "max_tokens", error


def test_the_served_name_outlives_a_worker_restart():
    class Fleet:
        worker_info = None

    fleet = Fleet()
    name = served_model_name("", fleet)
    assert name() == ""  # nothing known yet: names are not checked
    fleet.worker_info = type("Info", (), {"model": SERVED})()
    assert name() == SERVED
    fleet.worker_info = None  # restarting
    assert name() == SERVED
    assert served_model_name("mine", fleet)() == "mine"
