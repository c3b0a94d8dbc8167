"""The OpenAI-compatible HTTP front, driven by the real `openai` client and by curl, against gRPC Generate."""
from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from tests.integration.stack import child_pids, free_port, make_stack
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi in 中文"}]


@pytest.fixture()
def client(stack):
    with openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def grpc_generate(gateway, **fields) -> tuple[str, list[gateway_pb2.GenerateResponse]]:
    messages = list(gateway.Generate(gateway_pb2.GenerateRequest(**fields)))
    return "".join(m.text for m in messages), messages


def test_completion_greedy_equals_grpc(client, gateway):
    want, messages = grpc_generate(gateway, prompt=PROMPT, max_tokens=24, temperature=0)
    reply = client.completions.create(model="", prompt=PROMPT, max_tokens=24, temperature=0)
    assert reply.object == "text_completion" and len(reply.choices) == 1
    assert reply.choices[0].text == want
    usage = messages[-1].usage
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (usage.prompt_tokens,
                                                                          usage.completion_tokens)
    assert reply.usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_completion_stream_with_usage(client, gateway):
    want, messages = grpc_generate(gateway, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model="", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    # A chunk per token, or fewer: tokens that come faster than chunks go out share one.
    assert "".join(texts) == want and 1 < len(texts) <= messages[-1].usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == messages[-1].usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_with_continuous_usage_counts_every_chunk(client, gateway):
    # vLLM's continuous_usage_stats (guidellm sends it): each chunk's usage is the tokens so far.
    _, messages = grpc_generate(gateway, prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    chunks = list(client.completions.create(
        model="", prompt=PROMPT, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counted = [(c.usage.prompt_tokens, c.usage.completion_tokens) for c in chunks if c.choices]
    prompt = messages[-1].usage.prompt_tokens
    # One chunk per token unless several came at once: then a chunk counts them all.
    assert {p for p, _ in counted} == {prompt} and counted[0][1] >= 1 and counted[-1][1] == 12
    assert all(a < b for (_, a), (_, b) in zip(counted, counted[1:]))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completion_without_max_tokens_stops_at_16(client):
    reply = client.completions.create(model="", prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"


def test_chat_greedy_equals_grpc_streaming_and_not(client, gateway):
    want, _ = grpc_generate(gateway, messages=[gateway_pb2.ChatMessage(**m) for m in MESSAGES],
                            enable_thinking=False, max_tokens=16, temperature=0)
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    reply = client.chat.completions.create(model="", messages=MESSAGES, max_completion_tokens=16,
                                           temperature=0, extra_body=extra)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content == want
    chunks = list(client.chat.completions.create(model="", messages=MESSAGES, max_tokens=16, temperature=0,
                                                 stream=True, extra_body=extra))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def test_completion_logprobs_match_grpc(client, gateway):
    _, messages = grpc_generate(gateway, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)
    reply = client.completions.create(model="", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
    lp = reply.choices[0].logprobs
    want = [m.logprobs[0] for m in messages]
    assert lp.token_logprobs == pytest.approx([w.chosen.logprob for w in want], abs=1e-5)
    assert [len(top) for top in lp.top_logprobs] == [2] * 8
    assert [sorted(top.values(), reverse=True) for top in lp.top_logprobs] == \
        [pytest.approx([t.logprob for t in w.top], abs=1e-5) for w in want]
    assert len(lp.tokens) == 8 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs_bytes_add_up_to_the_text(client, stack):
    reply = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=12, temperature=0,
                                           logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 12 and all(len(entry.top_logprobs) == 3 for entry in content)
    assert b"".join(bytes(entry.bytes) for entry in content).decode("utf-8", errors="replace") == \
        reply.choices[0].message.content
    assert all(entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob for entry in content)


def test_stop_string_as_grpc(client, gateway):
    full, _ = grpc_generate(gateway, prompt=PROMPT, max_tokens=24, temperature=0)
    stop = full[len(full) // 2: len(full) // 2 + 2]
    want, messages = grpc_generate(gateway, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert messages[-1].finish_reason == gateway_pb2.FINISH_REASON_STOP
    reply = client.completions.create(model="", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
    assert reply.choices[0].text == want and reply.choices[0].finish_reason == "stop"


def test_seed_reproduces_and_n_fans_out(client):
    def sample(n):
        return client.completions.create(model="", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=1234,
                                         n=n, extra_body={"top_k": 0, "ignore_eos": True})
    first, second, pair = sample(1), sample(1), sample(2)
    assert first.choices[0].text == second.choices[0].text
    assert sorted(c.index for c in pair.choices) == [0, 1]
    assert pair.choices[0].text == first.choices[0].text  # choice 0 keeps the seed; choice 1 takes seed + 1
    assert pair.choices[1].text != pair.choices[0].text
    assert pair.usage.completion_tokens == 32
    streamed = list(client.completions.create(model="", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=1234,
                                              n=2, stream=True, extra_body={"top_k": 0, "ignore_eos": True}))
    for index in (0, 1):
        assert "".join(c.choices[0].text for c in streamed if c.choices[0].index == index) == \
            pair.choices[index].text


def test_bad_requests_are_400_with_the_message(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="", prompt=PROMPT, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="n must be"):
        client.completions.create(model="", prompt=PROMPT, n=0)
    with pytest.raises(openai.BadRequestError, match=r"max_tokens must be in \[1, \d+\] for this prompt of \d+ tokens"):
        client.chat.completions.create(model="", messages=MESSAGES, max_tokens=1020)


def test_model_id_is_the_checkpoint_folder_name(client, gateway, checkpoint):
    """Not the --model path as given: tools look the id up on a hub, where a path means nothing."""
    assert [m.id for m in client.models.list().data] == [checkpoint.name]
    assert gateway.GetInfo(gateway_pb2.GetInfoRequest()).model == checkpoint.name


def test_models_and_health(client, stack):
    models = client.models.list()
    assert len(models.data) == 1 and models.data[0].id
    retrieved = client.models.retrieve(models.data[0].id)
    assert (retrieved.id, retrieved.object) == (models.data[0].id, "model")
    with pytest.raises(openai.NotFoundError) as refused:
        client.models.retrieve("no-such-model")
    assert (refused.value.type, refused.value.param, refused.value.code) == \
        ("invalid_request_error", "model", "model_not_found")
    out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", stack.http_url + "/health"], capture_output=True,
                         text=True, timeout=30).stdout
    assert out.splitlines()[-1] == "200"


MAX_BODY_BYTES = 4 << 20  # the gateway's default --max-message-bytes


def chunked_upload(url: str, path: str, chunks, finish: bool) -> socket.socket:
    """A POST whose body goes out in chunks with no content-length, as a streaming client sends it."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n".encode())
    for chunk in chunks:
        sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    if finish:
        sock.sendall(b"0\r\n\r\n")
    return sock


def test_chunked_body_over_the_limit_is_refused_before_it_ends(stack):
    """A chunked body names no length: the gateway counts its bytes as they come and answers at the limit."""
    over = [b"x" * (64 << 10)] * ((MAX_BODY_BYTES >> 16) + 16)  # 1 MiB past the limit, and never finished
    with chunked_upload(stack.http_url, "/v1/completions", over, finish=False) as sock:
        reply = http.client.HTTPResponse(sock)
        reply.begin()  # before the fix: the body was awaited to its end, so this timed out
        error = json.loads(reply.read())["error"]
        assert reply.status == 413 and str(MAX_BODY_BYTES) in error["message"]
        # The rest of the upload is not read: the gateway closes the connection.
        assert reply.getheader("connection") == "close"
        sock.settimeout(30)
        try:
            while sock.recv(1 << 16):
                pass
        except ConnectionResetError:
            pass


def test_chunked_body_under_the_limit_is_served(stack, gateway):
    want, _ = grpc_generate(gateway, prompt=PROMPT, max_tokens=4, temperature=0)
    body = json.dumps({"model": "", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).encode()
    with chunked_upload(stack.http_url, "/v1/completions", [body[:10], body[10:]], finish=True) as sock:
        reply = http.client.HTTPResponse(sock)
        reply.begin()
        assert reply.status == 200 and json.loads(reply.read())["choices"][0]["text"] == want


def curl_stream(url: str, body: dict, *headers: str) -> subprocess.Popen:
    extra = [arg for header in headers for arg in ("-H", header)]
    return subprocess.Popen(["curl", "-sN", url, "-H", "Content-Type: application/json", *extra,
                             "-d", json.dumps(body)], stdout=subprocess.PIPE, text=True)


def test_curl_streams_server_sent_events(stack, gateway):
    want, _ = grpc_generate(gateway, prompt=PROMPT, max_tokens=12, temperature=0)
    curl = curl_stream(stack.http_url + "/v1/completions",
                       {"model": "", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True})
    out, _ = curl.communicate(timeout=120)
    lines = out.split("\n")
    assert lines[-3:] == ["data: [DONE]", "", ""]
    events = lines[:-3]
    # Each event is one `data: {json}` line followed by a blank line.
    assert all(line == "" for line in events[1::2])
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[0::2]]
    assert all(line.startswith("data: {") for line in events[0::2])
    assert "".join(c["choices"][0]["text"] for c in chunks) == want


def wait_idle(worker, timeout: float = 10.0) -> worker_pb2.GetInfoResponse:
    deadline = time.monotonic() + timeout
    while True:
        info = worker.GetInfo(worker_pb2.GetInfoRequest())
        if (info.running, info.waiting, info.kv_blocks_used) == (0, 0, 0) or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def test_curl_disconnect_frees_the_workers_blocks(stack, worker):
    curl = curl_stream(stack.http_url + "/v1/chat/completions",
                       {"model": "", "messages": MESSAGES, "max_tokens": 1000, "stream": True,
                        "ignore_eos": True}, "x-request-id: curl-disconnect")
    for _ in range(6):
        assert curl.stdout.readline()  # streaming has started
    busy = worker.GetInfo(worker_pb2.GetInfoRequest())
    assert busy.running == 1 and busy.kv_blocks_used > 0
    curl.kill()
    curl.wait()
    assert_cancelled_and_freed(stack, worker, "curl-disconnect", 1000)


def assert_cancelled_and_freed(stack, worker, request_id: str, max_tokens: int) -> None:
    """The worker is idle with no blocks held, freed by the cancel (logged as such), not by running to max_tokens."""
    info = wait_idle(worker)
    assert (info.running, info.waiting, info.kv_blocks_used) == (0, 0, 0)
    deadline = time.monotonic() + 10
    while f"request {request_id}: CANCELLED" not in stack.gateway.log():
        assert time.monotonic() < deadline, stack.gateway.log()[-2000:]
        time.sleep(0.05)
    line = next(x for x in stack.gateway.log().splitlines() if f"request {request_id}:" in x)
    assert int(re.search(r"completion (\d+) tokens", line).group(1)) < max_tokens


@pytest.fixture(scope="module")
def keyed_small_stack(checkpoint, tmp_path_factory):
    http_port = free_port()
    stack = make_stack(str(checkpoint), str(tmp_path_factory.mktemp("logs-http-small")),
                       worker_flags=["--max-num-seqs", "1", "--max-waiting", "1"],
                       gateway_flags=["--http-port", str(http_port), "--api-key", "sesame"])
    stack.http_url = f"http://127.0.0.1:{http_port}"
    stack.start()
    yield stack
    stack.stop()


def test_api_key_and_full_queue(keyed_small_stack):
    url = keyed_small_stack.http_url + "/v1"
    with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError, match="invalid API key"):
            bad.completions.create(model="", prompt=PROMPT, max_tokens=4)
    with openai.OpenAI(base_url=url, api_key="sesame", max_retries=0, timeout=300) as good, \
            grpc.insecure_channel(keyed_small_stack.gateway.address) as channel, ThreadPoolExecutor(2) as pool:
        assert good.completions.create(model="", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
        # Over gRPC the same key is required: one running and one waiting sequence fill the worker.
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        started = threading.Event()

        def long_stream(i):
            for _ in stub.Generate(gateway_pb2.GenerateRequest(prompt=f"long {i}", max_tokens=400, ignore_eos=True),
                                   metadata=[("authorization", "Bearer sesame")]):
                started.set()
        calls = [pool.submit(long_stream, 0)]
        assert started.wait(120)
        calls.append(pool.submit(long_stream, 1))
        worker = worker_pb2_grpc.ModelWorkerServiceStub(grpc.insecure_channel(keyed_small_stack.worker.address))
        deadline = time.monotonic() + 60
        while worker.GetInfo(worker_pb2.GetInfoRequest()).waiting < 1:
            assert time.monotonic() < deadline, "the second stream never queued"
            time.sleep(0.05)
        with pytest.raises(openai.RateLimitError, match="queue is full"):
            good.completions.create(model="", prompt=PROMPT, max_tokens=2)
        for call in calls:
            call.result(timeout=300)


def test_non_streaming_disconnect_frees_the_workers_blocks(stack, worker):
    """A client that gives up on a non-streaming completion cancels it, though nothing was written to it yet."""
    curl = subprocess.Popen(["curl", "-s", stack.http_url + "/v1/completions", "-H", "Content-Type: application/json",
                             "-H", "x-request-id: curl-gives-up", "-d",
                             json.dumps({"model": "", "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True})],
                            stdout=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while worker.GetInfo(worker_pb2.GetInfoRequest()).running != 1:
        assert time.monotonic() < deadline and curl.poll() is None
        time.sleep(0.05)
    curl.kill()
    curl.wait()
    assert_cancelled_and_freed(stack, worker, "curl-gives-up", 1000)


HTTP_DEADLINE_S = 3


@pytest.fixture(scope="module")
def deadline_stack(checkpoint, tmp_path_factory):
    http_port = free_port()
    stack = make_stack(str(checkpoint), str(tmp_path_factory.mktemp("logs-http-deadline")),
                       gateway_flags=["--http-port", str(http_port), "--http-request-timeout", str(HTTP_DEADLINE_S)])
    stack.http_url = f"http://127.0.0.1:{http_port}"
    stack.start()
    yield stack
    stack.stop()


@contextlib.contextmanager
def engine_hung(stack):
    """The worker's engine core stopped, as a hung one: the worker's front still answers, no step is made."""
    (core,) = child_pids(stack.worker.process.pid)
    os.kill(core, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(core, signal.SIGCONT)


def test_http_deadline_ends_requests_on_a_hung_engine(deadline_stack):
    with openai.OpenAI(base_url=deadline_stack.http_url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        stream = client.completions.create(model="", prompt=PROMPT, max_tokens=1000, stream=True,
                                           extra_body={"ignore_eos": True})
        assert next(iter(stream)).choices  # streaming has started
        with engine_hung(deadline_stack):
            # Without a deadline both would wait on the engine until the client's own timeout.
            with pytest.raises(openai.APIError, match="--http-request-timeout") as ended:
                for _ in stream:
                    pass
            assert ended.value.type == "timeout"
            with pytest.raises(openai.InternalServerError, match="--http-request-timeout") as refused:
                client.completions.create(model="", prompt=PROMPT, max_tokens=4)
            assert refused.value.status_code == 504 and refused.value.type == "timeout"
    # Both were cancelled on the worker: once its engine runs again, it holds nothing for them.
    with grpc.insecure_channel(deadline_stack.worker.address) as channel:
        info = wait_idle(worker_pb2_grpc.ModelWorkerServiceStub(channel))
    assert (info.running, info.waiting, info.kv_blocks_used) == (0, 0, 0)
