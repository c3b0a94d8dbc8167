"""Tests for the command-line client's request building and its output against a fake gateway."""

from concurrent import futures

import grpc
import pytest

from gateway.client import build_request, main, parse_args
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc

SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logprobs",
)


def request(*argv: str) -> gateway_pb2.GenerateRequest:
    return build_request(parse_args(list(argv)))


def test_plain_prompt_leaves_every_optional_but_max_tokens_unset():
    req = request("Once upon a time")
    assert req.prompt == "Once upon a time"
    assert len(req.messages) == 0
    for name in (*SAMPLING_FIELDS[1:], "enable_thinking", "skip_special_tokens"):
        assert not req.HasField(name), name
    assert list(req.stop) == [] and not req.ignore_eos
    # Unset, the server would run to the end of the context: the client asks for 256, and says so.
    assert req.HasField("max_tokens") and req.max_tokens == 256
    assert not request("hi", "--max-tokens", "0").HasField("max_tokens")


def test_help_states_the_max_tokens_default_and_version_is_reported(capsys):
    for flag in ("--help", "--version"):
        with pytest.raises(SystemExit) as done:
            parse_args([flag])
        assert done.value.code == 0
    out = capsys.readouterr().out
    assert "default: 256" in out.replace("\n", " ").replace("  ", " ")
    assert "gateway.client (vllm-v0) 0." in out


def test_given_flags_are_set_including_zeros():
    req = request(
        "hi",
        "--max-tokens", "12",
        "--temperature", "0",
        "--top-p", "0.5",
        "--top-k", "0",
        "--min-p", "0.25",
        "--repetition-penalty", "1.5",
        "--presence-penalty", "0",
        "--frequency-penalty", "-1",
        "--seed", "0",
        "--logprobs", "0",
    )  # fmt: skip
    for name in SAMPLING_FIELDS:
        assert req.HasField(name), name
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k) == (12, 0.0, 0.5, 0)
    assert (req.min_p, req.repetition_penalty) == (0.25, 1.5)
    assert (req.presence_penalty, req.frequency_penalty, req.seed, req.logprobs) == (0.0, -1.0, 0, 0)


def test_only_the_given_sampling_flag_is_set():
    req = request("hi", "--top-k", "40")
    assert req.top_k == 40
    assert [name for name in SAMPLING_FIELDS[1:] if req.HasField(name)] == ["top_k"]


def test_stops_and_other_switches():
    req = request(
        "hi", "--stop", "\n\n", "--stop", "END", "--stop-token-id", "7", "--ignore-eos",
        "--keep-special-tokens", "--request-id", "r-1",
    )  # fmt: skip
    assert list(req.stop) == ["\n\n", "END"]
    assert list(req.stop_token_ids) == [7]
    assert req.ignore_eos
    assert req.HasField("skip_special_tokens") and not req.skip_special_tokens
    assert req.request_id == "r-1"


def test_chat_builds_one_user_message():
    req = request("--chat", "What is 2+2?")
    assert req.prompt == ""
    assert [(m.role, m.content) for m in req.messages] == [("user", "What is 2+2?")]
    assert not req.HasField("enable_thinking")


def test_chat_with_system_and_no_think():
    req = request("--chat", "--system", "Be brief.", "--no-think", "Hello")
    assert [(m.role, m.content) for m in req.messages] == [("system", "Be brief."), ("user", "Hello")]
    assert req.HasField("enable_thinking") and req.enable_thinking is False


def test_system_alone_implies_chat():
    req = request("--system", "Be brief.", "Hello")
    assert [m.role for m in req.messages] == ["system", "user"]


@pytest.mark.parametrize("flag, value, bounds", [
    ("--max-tokens", "-1", "[0, 4294967295]"), ("--seed", "-1", "[0, 18446744073709551615]"),
    ("--logprobs", "-1", "[0, 4294967295]"), ("--stop-token-id", "-5", "[0, 4294967295]"),
    ("--top-k", "-2", "[-1, 2147483647]"), ("--max-tokens", "4294967296", "[0, 4294967295]"),
    ("--seed", "18446744073709551616", "[0, 18446744073709551615]"), ("--logprobs", "two", "not an integer"),
])
def test_out_of_range_integers_are_a_one_line_usage_error(flag, value, bounds, capsys):
    """Values the proto field cannot hold fail in argparse, before any request is built or sent."""
    with pytest.raises(SystemExit) as done:
        main(["hi", "--addr", "127.0.0.1:1", flag, value])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"python -m gateway.client: error: argument {flag}: ") and bounds in last, err


def test_the_ends_of_each_integer_range_are_accepted():
    req = request("hi", "--max-tokens", "4294967295", "--seed", str(2**64 - 1), "--logprobs", "0", "--top-k", "-1",
                  "--stop-token-id", "0")
    assert (req.max_tokens, req.seed, req.logprobs, req.top_k, list(req.stop_token_ids)) == (
        2**32 - 1, 2**64 - 1, 0, -1, [0])


def test_address_and_key_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_V0_GATEWAY_ADDR", "gw:1234")
    monkeypatch.setenv("VLLM_V0_API_KEY", "secret")
    args = parse_args(["hi"])
    assert (args.addr, args.api_key) == ("gw:1234", "secret")
    monkeypatch.delenv("VLLM_V0_GATEWAY_ADDR")
    monkeypatch.delenv("VLLM_V0_API_KEY")
    args = parse_args(["hi"])
    assert (args.addr, args.api_key) == ("localhost:50051", None)


# --- against a fake gateway -----------------------------------------------------------


class FakeGateway(gateway_pb2_grpc.GatewayServiceServicer):
    """Streams a fixed completion, or fails when the prompt asks it to."""

    def __init__(self):
        self.requests, self.metadata = [], []

    def Generate(self, request, context):
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        if request.prompt == "fail":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1], got 2")
        if request.prompt == "huge":  # what grpc itself answers a message over the server's limit
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (9 vs. 4)")
        logprobs = [gateway_pb2.Logprobs(chosen=gateway_pb2.TokenLogprob(token_id=t, logprob=-0.5),
                                         top=[gateway_pb2.TokenLogprob(token_id=9, logprob=-1.5)])
                    for t in (1, 2)] if request.HasField("logprobs") else [None, None]
        if request.prompt == "think":
            yield gateway_pb2.GenerateResponse(reasoning_text="Hmm.", token_ids=[7])
            yield gateway_pb2.GenerateResponse(token_ids=[8], tool_calls=[gateway_pb2.ToolCall(id="call_1", name="f")])
            yield gateway_pb2.GenerateResponse(token_ids=[9], tool_calls=[gateway_pb2.ToolCall(id="call_1",
                                                                                               arguments="{}")])
        yield gateway_pb2.GenerateResponse(text="Hel", token_ids=[1], request_id="r-9",
                                           logprobs=logprobs[:1] if logprobs[0] else [])
        yield gateway_pb2.GenerateResponse(text="lo", token_ids=[2], logprobs=logprobs[1:] if logprobs[1] else [])
        yield gateway_pb2.GenerateResponse(
            finish_reason=gateway_pb2.FINISH_REASON_STOP,
            stop_reason="END",
            usage=gateway_pb2.Usage(prompt_tokens=3, completion_tokens=2),
            time_to_first_token_s=0.25,
            request_id="r-9",
        )


@pytest.fixture
def fake_gateway():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = FakeGateway()
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def test_streams_text_then_summary(fake_gateway, capsys):
    servicer, addr = fake_gateway
    code = main(["Say hi", "--addr", addr, "--api-key", "k1", "--timeout", "10", "--stop", "END"])
    out, err = capsys.readouterr()
    assert code == 0
    assert out == "Hello"  # piped: exactly the completion
    assert err.startswith("\nfinish_reason: stop")  # the summary does not run into the text
    for expected in ("finish_reason: stop", "stop_reason: 'END'", "prompt_tokens: 3",
                     "completion_tokens: 2", "time_to_first_token: 0.250 s"):  # fmt: skip
        assert expected in err
    assert servicer.requests[0].prompt == "Say hi"
    assert servicer.metadata[0]["authorization"] == "Bearer k1"


def test_reasoning_and_tool_calls_go_to_stderr(fake_gateway, capsys):
    _, addr = fake_gateway
    assert main(["think", "--addr", addr]) == 0
    out, err = capsys.readouterr()
    assert out == "Hello" and err.startswith("Hmm.\ntool call call_1: f {}")


def test_no_key_sends_no_authorization(fake_gateway, capsys, monkeypatch):
    monkeypatch.delenv("VLLM_V0_API_KEY", raising=False)
    servicer, addr = fake_gateway
    assert main(["hi", "--addr", addr]) == 0
    assert "authorization" not in servicer.metadata[0]


def test_rpc_error_is_printed_with_its_code(fake_gateway, capsys):
    _, addr = fake_gateway
    code = main(["fail", "--addr", addr])
    _, err = capsys.readouterr()
    assert code != 0
    assert "error: INVALID_ARGUMENT: top_p must be in (0, 1], got 2" in err


def test_unreachable_gateway_is_an_error(capsys):
    # Port 1 on loopback refuses connections; the short deadline bounds the wait.
    code = main(["hi", "--addr", "127.0.0.1:1", "--timeout", "2"])
    _, err = capsys.readouterr()
    assert code != 0
    assert "error: UNAVAILABLE" in err or "error: DEADLINE_EXCEEDED" in err


def test_logprobs_show_each_token_text(fake_gateway, capsys):
    _, addr = fake_gateway
    assert main(["hi", "--addr", addr, "--logprobs", "1"]) == 0
    err = capsys.readouterr().err.splitlines()
    lines = [line.split() for line in err if line.strip().startswith(("1 ", "2 "))]
    assert lines == [["1", "'Hel'", "-0.5000", "9:-1.500"], ["2", "'lo'", "-0.5000", "9:-1.500"]]


def test_an_oversized_request_names_the_limit_and_says_not_to_retry(fake_gateway, capsys):
    _, addr = fake_gateway
    assert main(["huge", "--addr", addr]) != 0
    err = capsys.readouterr().err
    assert "RESOURCE_EXHAUSTED" in err and "--max-message-bytes" in err and "retrying will not help" in err
