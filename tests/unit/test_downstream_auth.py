"""The key the gateway sends to the tokenizer and workers: every call shape carries it, and which key it is."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.fleet.downstream import DownstreamTLS, open_channel
from gateway.main import downstream_api_key, parse_args
from rpcserver.auth import ApiKeyInterceptor

KEY = "internal-7c1e"


def _echo_metadata(context) -> bytes:
    metadata = dict(context.invocation_metadata())
    return f"{metadata.get('authorization')}|{metadata.get('x-extra')}".encode()


async def _unary_unary(request, context):
    return _echo_metadata(context)


async def _unary_stream(request, context):
    yield _echo_metadata(context)


async def _stream_unary(requests, context):
    async for _ in requests:
        pass
    return _echo_metadata(context)


async def _stream_stream(requests, context):
    async for _ in requests:
        yield _echo_metadata(context)


async def _calls(channel: grpc.aio.Channel, metadata=None) -> list[bytes | grpc.StatusCode]:
    """One call of each shape, as the gateway makes them; each one's reply, or its status if refused."""
    async def requests():
        yield b"x"

    async def written():  # the detokenizer's shape: a call opened without requests, then written to
        call = channel.stream_stream("/test.Echo/StreamStream")(metadata=metadata)
        await call.write(b"x")
        reply = await call.read()
        await call.done_writing()
        return reply

    shapes = [
        lambda: channel.unary_unary("/test.Echo/UnaryUnary")(b"x", metadata=metadata),
        lambda: _first(channel.unary_stream("/test.Echo/UnaryStream")(b"x", metadata=metadata)),
        lambda: channel.stream_unary("/test.Echo/StreamUnary")(requests(), metadata=metadata),
        lambda: _first(channel.stream_stream("/test.Echo/StreamStream")(requests(), metadata=metadata)),
        written,
    ]
    results = []
    for shape in shapes:
        try:
            results.append(await shape())
        except grpc.aio.AioRpcError as e:
            results.append(e.code())
    return results


async def _first(call):
    async for reply in call:
        return reply


def test_every_call_shape_carries_the_downstream_key_and_keeps_its_own_metadata():
    async def scenario():
        server = grpc.aio.server(interceptors=[ApiKeyInterceptor(KEY)])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Echo", {
            "UnaryUnary": grpc.unary_unary_rpc_method_handler(_unary_unary),
            "UnaryStream": grpc.unary_stream_rpc_method_handler(_unary_stream),
            "StreamUnary": grpc.stream_unary_rpc_method_handler(_stream_unary),
            "StreamStream": grpc.stream_stream_rpc_method_handler(_stream_stream),
        })])
        address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        try:
            keyed = open_channel(address, DownstreamTLS(), KEY)
            plain = open_channel(address, DownstreamTLS())
            wrong = open_channel(address, DownstreamTLS(), "not-it")
            try:
                return (await _calls(keyed), await _calls(keyed, (("x-extra", "1"),)), await _calls(plain),
                        await _calls(wrong))
            finally:
                for channel in (keyed, plain, wrong):
                    await channel.close()
        finally:
            await server.stop(None)

    keyed, extra, plain, wrong = asyncio.run(scenario())
    assert keyed == [f"Bearer {KEY}|None".encode()] * 5
    assert extra == [f"Bearer {KEY}|1".encode()] * 5
    assert plain == wrong == [grpc.StatusCode.UNAUTHENTICATED] * 5


@pytest.mark.parametrize("argv, want", [
    ([], None),
    (["--api-key", "client-key"], "client-key"),  # one key for all three services
    (["--api-key", "client-key", "--downstream-api-key", "internal"], "internal"),
    (["--downstream-api-key", "internal"], "internal"),
])
def test_the_key_sent_downstream_defaults_to_the_gateways_own(argv, want, monkeypatch):
    for name in ("VLLM_V0_API_KEY", "VLLM_V0_API_KEY_FILE", "VLLM_V0_DOWNSTREAM_API_KEY",
                 "VLLM_V0_DOWNSTREAM_API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert downstream_api_key(parse_args(argv)) == want


def test_the_downstream_key_comes_from_a_file_or_the_environment(tmp_path, monkeypatch):
    key_file = tmp_path / "key"
    key_file.write_text(" from-file\n")
    assert downstream_api_key(parse_args(["--downstream-api-key-file", str(key_file)])) == "from-file"
    monkeypatch.setenv("VLLM_V0_DOWNSTREAM_API_KEY", "from-env")
    assert downstream_api_key(parse_args([])) == "from-env"
    with pytest.raises(SystemExit, match="give --downstream-api-key or --downstream-api-key-file, not both"):
        downstream_api_key(parse_args(["--downstream-api-key-file", str(key_file)]))
    (tmp_path / "empty").write_text("\n")
    monkeypatch.delenv("VLLM_V0_DOWNSTREAM_API_KEY")
    with pytest.raises(SystemExit, match="is empty"):
        downstream_api_key(parse_args(["--downstream-api-key-file", str(tmp_path / "empty")]))
