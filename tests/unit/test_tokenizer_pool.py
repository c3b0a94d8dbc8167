"""The gateway's tokenizer pool over fake tokenizers (no sockets): which one serves a call, and retries on another."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from gateway.fleet.fleet_metrics import RESUMED
from gateway.fleet.tokenizers import TokenizerPool
from gateway.fleet.worker_stream import ResumePolicy
from gateway.fleet.workers import NOT_SERVING, SERVING, UNREACHABLE
from rpcserver.errors import Unavailable
from vllm_v0.tokenizer.v1 import tokenizer_pb2

WAIT_S = 30.0  # bounds a test that would otherwise hang; never a measure of speed


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class FakeStub:
    """Encode answers with the tokenizer's name as the rendered text, or raises the next scripted error."""

    def __init__(self, owner: FakeTokenizer):
        self.owner = owner
        self.calls: list[float | None] = []  # the timeout of each call

    async def Encode(self, request, timeout=None):
        self.calls.append(timeout)
        if self.owner.errors:
            error = self.owner.errors.pop(0)
            if error.code() == grpc.StatusCode.UNAVAILABLE and self.owner.dies:
                self.owner.alive = False
            raise error
        return tokenizer_pb2.EncodeResponse(token_ids=[1, 2], rendered=self.owner.address)

    def DecodeBatches(self, timeout=None):
        self.owner.decode_calls += 1
        return f"call on {self.owner.address}"


class FakeTokenizer:
    """A pool entry: its state as health checks find it; a check sees whether it is `alive`."""

    def __init__(self, address: str, state: str = SERVING, errors=(), dies: bool = True):
        self.address, self.state = address, state
        self.alive = state == SERVING
        self.errors, self.dies = list(errors), dies  # dies: an UNAVAILABLE it raises means it is gone
        self.stub = FakeStub(self)
        self.checks = 0
        self.decode_calls = 0

    @property
    def serving(self) -> bool:
        return self.state == SERVING

    async def check_now(self) -> bool:
        self.checks += 1
        self.state = SERVING if self.alive else UNREACHABLE
        return self.serving

    async def close(self) -> None:
        pass


def pool_of(*tokenizers: FakeTokenizer, resume: ResumePolicy = ResumePolicy(max_resumes=3, wait_s=5.0)):
    pool = TokenizerPool([t.address for t in tokenizers], open_channel=None, interval=0.05, resume=resume)
    pool.tokenizers = {t.address: t for t in tokenizers}
    return pool


def encode(pool: TokenizerPool, timeout: float | None = 10.0):
    async def main():
        return await pool.Encode(tokenizer_pb2.EncodeRequest(text="hi"), timeout=timeout)
    return asyncio.run(asyncio.wait_for(main(), WAIT_S))


def retries() -> float:
    return RESUMED.labels("encode")._value.get()


def test_encode_unavailable_on_one_is_retried_on_the_other():
    a = FakeTokenizer("a:1", errors=[rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed")])
    b = FakeTokenizer("b:2")
    before = retries()
    reply = encode(pool_of(a, b))
    assert reply.rendered == "b:2" and len(a.stub.calls) == len(b.stub.calls) == 1
    assert a.checks == 1 and a.state == UNREACHABLE  # checked at once, out of the rotation
    assert retries() == before + 1
    assert 0 < b.stub.calls[0] <= 10.0  # within what was left of the request's timeout


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_the_requests_own_errors_are_never_retried(code):
    a = FakeTokenizer("a:1", errors=[rpc_error(code, "the request's own")])
    b = FakeTokenizer("b:2")
    before = retries()
    with pytest.raises(grpc.aio.AioRpcError) as error:
        encode(pool_of(a, b))
    assert error.value.code() == code and b.stub.calls == [] and a.checks == 0
    assert retries() == before


def test_retries_stop_at_max_resumes():
    unavailable = [rpc_error(grpc.StatusCode.UNAVAILABLE, "draining") for _ in range(10)]
    # Both keep passing their health checks, so every retry finds one to go to.
    a = FakeTokenizer("a:1", errors=unavailable[:5], dies=False)
    b = FakeTokenizer("b:2", errors=unavailable[5:], dies=False)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        encode(pool_of(a, b, resume=ResumePolicy(max_resumes=2, wait_s=5.0)))
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(a.stub.calls) + len(b.stub.calls) == 3  # the call and two retries
    assert len(a.stub.calls) >= 1 and len(b.stub.calls) >= 1  # a retry goes to the other one


def test_the_same_tokenizer_takes_the_retry_once_it_serves_again():
    a = FakeTokenizer("a:1", errors=[rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed")])
    pool = pool_of(a)

    async def main():
        async def restart():
            await asyncio.sleep(0.1)
            a.alive, a.state = True, SERVING
            pool._changed()
        restarting = asyncio.create_task(restart())
        reply = await pool.Encode(tokenizer_pb2.EncodeRequest(text="hi"), timeout=10.0)
        await restarting
        return reply

    reply = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert reply.rendered == "a:1" and len(a.stub.calls) == 2


@pytest.mark.parametrize("wait_s, timeout", [(0.2, 30.0), (30.0, 0.2)])
def test_the_wait_for_a_serving_tokenizer_is_bounded_by_resume_wait_and_the_timeout(wait_s, timeout):
    a = FakeTokenizer("a:1", errors=[rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed")])
    b = FakeTokenizer("b:2", state=NOT_SERVING)
    start = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as error:
        encode(pool_of(a, b, resume=ResumePolicy(max_resumes=3, wait_s=wait_s)), timeout=timeout)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no tokenizer service is serving (a:1 failed: Socket closed" in error.value.details()
    assert time.monotonic() - start < 10.0  # ended by the smaller bound, not the larger
    assert b.stub.calls == []


def test_decode_batches_opens_on_a_serving_one_and_reopens_on_another_when_it_fails():
    a, b = FakeTokenizer("a:1"), FakeTokenizer("b:2")
    pool = pool_of(a, b)

    async def main():
        first = pool.DecodeBatches()
        on = a if first == "call on a:1" else b
        on.alive = False  # the call on it broke: it died
        second, address = await pool.open_decode_batches(5.0)
        return on, second, address

    on, second, address = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    other = b if on is a else a
    assert on.checks == 1 and address == other.address and second == f"call on {other.address}"


def test_open_decode_batches_is_unavailable_when_none_serves_within_the_wait():
    a = FakeTokenizer("a:1", state=UNREACHABLE)
    pool = pool_of(a)

    async def main():
        return await pool.open_decode_batches(0.1)

    with pytest.raises(Unavailable, match=r"no tokenizer service is serving \(waited 0.1 s for one of a:1\)"):
        asyncio.run(asyncio.wait_for(main(), WAIT_S))


def test_calls_go_to_the_serving_tokenizers_in_turn():
    a, b, c = FakeTokenizer("a:1"), FakeTokenizer("b:2", state=NOT_SERVING), FakeTokenizer("c:3")
    pool = pool_of(a, b, c)
    replies = [encode(pool).rendered for _ in range(4)]
    assert sorted(replies) == ["a:1", "a:1", "c:3", "c:3"]


def test_tokenizer_addr_takes_several_comma_separated_and_repeated(monkeypatch):
    from gateway.main import parse_args

    assert parse_args([]).tokenizer_addr == ["localhost:50052"]
    assert parse_args(["--tokenizer-addr", "a:1,b:2", "--tokenizer-addr", "b:2, dns:///t:3"]).tokenizer_addr == \
        ["a:1", "b:2", "dns:///t:3"]
    monkeypatch.setenv("VLLM_V0_TOKENIZER_ADDR", "x:1,y:2")
    assert parse_args([]).tokenizer_addr == ["x:1", "y:2"]


def test_a_dns_target_stands_for_every_address_it_resolves_to_each_interval(monkeypatch):
    answers = [["10.0.0.1:50052", "10.0.0.2:50052"], ["10.0.0.2:50052", "10.0.0.3:50052"]]

    async def resolve(target):
        return answers[0] if len(answers) == 1 else answers.pop(0)

    monkeypatch.setattr("gateway.fleet.members.resolve", resolve)  # wanted_addresses looks names up

    async def main():
        pool = TokenizerPool(["dns:///tokenizer:50052"], grpc.aio.insecure_channel, interval=0.05)
        await pool.start()
        first = sorted(pool.tokenizers)
        await asyncio.sleep(0.2)
        second = sorted(pool.tokenizers)
        await pool.close()
        return first, second

    first, second = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert first == ["10.0.0.1:50052", "10.0.0.2:50052"] and second == ["10.0.0.2:50052", "10.0.0.3:50052"]
