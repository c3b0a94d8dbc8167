"""Routing by LoRA adapter: adapter-keyed block hashes from worker.proto's words, workers picked only when they
have the adapter, and a resumed stream that keeps its adapter and routes with it."""
from __future__ import annotations

import asyncio
import hashlib

import grpc
import pytest

from gateway.fleet.block_hash import prompt_block_hashes
from gateway.fleet.router import Router
from gateway.fleet.worker_stream import WorkerStream
from gateway.fleet.workers import SERVING, Fleet, Worker
from rpcserver.errors import Unavailable
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.block_manager import BlockManager, adapter_root
from services.model_worker.engine.sequence import Sequence
from tests.unit.test_block_hash import spec_hashes
from vllm_v0.worker.v1 import worker_pb2

BS = 4


def spec_adapter_hashes(ids: list[int], block_size: int, name: str) -> list[bytes]:
    """worker.proto, written out: hash(0) = SHA-256(SHA-256("adapter:" || name) || tokens(0)), then chained."""
    parent = hashlib.sha256("adapter:".encode() + name.encode("utf-8")).digest()
    out = []
    for i in range((len(ids) - 1) // block_size):
        block = ids[i * block_size:(i + 1) * block_size]
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(8, "little", signed=True) for t in block)).digest()
        out.append(parent)
    return out


def test_adapter_hashes_follow_the_proto_text():
    # One block of 1..4 under adapter "sql": the digest of "adapter:sql", then of it and 1,2,3,4 as int64 LE.
    root = hashlib.sha256(b"adapter:sql").digest()
    first = hashlib.sha256(root + bytes.fromhex("0100000000000000" "0200000000000000" "0300000000000000"
                                                "0400000000000000")).digest()
    assert prompt_block_hashes([1, 2, 3, 4, 9], 4, "sql") == [first]
    ids = list(range(1000, 1037))
    for name in ("sql", "é-ünïcode", "a" * 300):
        for block_size in (1, 4, 16):
            assert prompt_block_hashes(ids, block_size, name) == spec_adapter_hashes(ids, block_size, name)
    # The base model's chain is the unkeyed one, as before adapters; adapters and the base share no block.
    assert prompt_block_hashes(ids, BS) == prompt_block_hashes(ids, BS, "") == spec_hashes(ids, BS)
    chains = [set(prompt_block_hashes(ids, BS, name)) for name in ("", "sql", "chat")]
    assert all(not a & b for i, a in enumerate(chains) for b in chains[i + 1:])


def test_adapter_hashes_equal_the_workers():
    prompt = [(7 * i) % 151936 for i in range(3 * BS + 2)]
    bm = BlockManager(64, BS)
    seq = Sequence("r", prompt, SamplingParams(), 1, frozenset())
    seq.hash_root = adapter_root("sql")  # as the worker's engine sets it for a request with `adapter`
    bm.allocate(seq)
    seq.num_cached_tokens = len(seq)
    bm.commit(seq)
    cached = [bm.blocks[b].hash for b in seq.block_table if bm.blocks[b].hash is not None]
    assert cached[:3] == prompt_block_hashes(prompt, BS, "sql") != prompt_block_hashes(prompt, BS)


class _NoChannel:
    def unary_unary(self, *args, **kwargs):
        return None

    async def close(self):
        pass

    unary_stream = stream_unary = stream_stream = unary_unary


def fleet_of(adapters_by_worker: dict[str, tuple[str, ...]]) -> Fleet:
    """Serving workers that have these adapters loaded (as their GetInfo says), none of them checked."""
    fleet = Fleet([], open_channel=lambda address: None, interval=30.0, router=Router())
    for address, adapters in adapters_by_worker.items():
        worker = Worker(address, _NoChannel(), 30.0)
        worker.state, worker.block_size = SERVING, BS
        worker.info = worker_pb2.GetInfoResponse(max_context=1024, adapters=[
            worker_pb2.AdapterInfo(name=name, path=f"/adapters/{name}", rank=8) for name in adapters])
        fleet.workers[address] = worker
    return fleet


def holds(worker: Worker, ids: list[int], adapter: str = "") -> None:
    """The worker reports the blocks of `ids` computed with `adapter` in its cache."""
    worker.apply(worker_pb2.LoadUpdate(stored_block_hashes=prompt_block_hashes(ids + [0], BS, adapter), block_size=BS))


def test_an_adapter_prompt_goes_to_the_worker_holding_that_adapters_blocks():
    fleet = fleet_of({"a:1": ("sql",), "b:2": ("sql",), "c:3": ()})
    ids = list(range(100, 140))
    holds(fleet.workers["a:1"], ids)  # the same tokens, computed by the base model
    holds(fleet.workers["b:2"], ids, "sql")
    assert {fleet.pick(ids, adapter="sql").address for _ in range(6)} == {"b:2"}
    assert {fleet.pick(ids).address for _ in range(6)} == {"a:1"}
    # A miss spreads by load, over the workers that have the adapter only.
    other = list(range(500, 540))
    assert {fleet.pick(other, adapter="sql").address for _ in range(6)} == {"a:1", "b:2"}
    assert {fleet.pick(other).address for _ in range(6)} == {"a:1", "b:2", "c:3"}


def test_a_worker_without_the_adapter_is_never_picked_for_it():
    fleet = fleet_of({"a:1": ("sql",), "b:2": ("chat",)})
    ids = list(range(40))
    holds(fleet.workers["b:2"], ids, "sql")  # blocks alone do not make it serve the adapter
    assert {fleet.pick(ids, adapter="sql").address for _ in range(6)} == {"a:1"}
    assert {fleet.pick(ids, adapter="chat").address for _ in range(6)} == {"b:2"}
    assert fleet.pick(ids, adapter="sql", exclude=("a:1",)) is None
    assert fleet.pick(ids, adapter="none-such") is None
    assert sorted(fleet.adapters()) == ["chat", "sql"]
    assert fleet.knows_adapter("sql") and not fleet.knows_adapter("none-such")
    fleet.workers["a:1"].state = "not_serving"  # known still (it may come back), but not served now
    assert fleet.knows_adapter("sql") and sorted(fleet.adapters()) == ["chat"]


class Failed(grpc.aio.AioRpcError):
    def __init__(self):
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="gone")


class Call:
    """A Generate call: these tokens, then a finish, or an UNAVAILABLE failure."""

    def __init__(self, tokens: list[int], fail: bool):
        self.tokens, self.fail = tokens, fail

    def __aiter__(self):
        return self._steps()

    async def _steps(self):
        for i, t in enumerate(self.tokens):
            last = not self.fail and i == len(self.tokens) - 1
            yield worker_pb2.GenerateResponse(token_id=t, finish_reason=worker_pb2.FINISH_REASON_LENGTH if last else 0)
        if self.fail:
            raise Failed()

    def cancel(self):
        return True


def test_a_resumed_stream_keeps_its_adapter_and_routes_with_its_hashes():
    prompt, generated = list(range(100, 130)), [7, 8, 9, 10, 11, 12, 13, 14]
    fleet = fleet_of({"first:1": ("sql",), "keyed:2": ("sql",), "base:3": ("sql",), "other:4": ()})
    holds(fleet.workers["first:1"], prompt, "sql")
    # Prompt and generated ids together: the resumed request's blocks; only one worker has them under the adapter.
    holds(fleet.workers["keyed:2"], prompt + generated, "sql")
    holds(fleet.workers["base:3"], prompt + generated)
    holds(fleet.workers["other:4"], prompt + generated, "sql")  # but it does not have the adapter loaded
    fleet.workers["keyed:2"].load.running = 1  # holding the prompt too, it is second choice at the start
    got: dict[str, list[worker_pb2.GenerateRequest]] = {}
    script = {"first:1": Call(generated, fail=True), "keyed:2": Call([20, 21], fail=False)}
    for address, worker in fleet.workers.items():
        class Stub:
            def Generate(self, work, timeout=None, address=address):
                got.setdefault(address, []).append(work)
                return script[address]
        worker.stub = Stub()
    work = worker_pb2.GenerateRequest(request_id="r", prompt_token_ids=prompt, max_tokens=10, adapter="sql")

    async def run():
        return [step.token_id async for step in WorkerStream(fleet, work, 5.0)]
    assert asyncio.run(run()) == generated + [20, 21]
    assert list(got) == ["first:1", "keyed:2"]
    resumed = got["keyed:2"][0]
    assert resumed.adapter == "sql" and list(resumed.output_token_ids) == generated


def test_no_serving_worker_with_the_adapter_is_unavailable_naming_it():
    fleet = fleet_of({"a:1": ("sql",), "b:2": ()})
    fleet.workers["a:1"].state = "not_serving"
    work = worker_pb2.GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3], max_tokens=4, adapter="sql")

    async def run():
        return [step async for step in WorkerStream(fleet, work, 5.0)]
    with pytest.raises(Unavailable, match="no serving model worker has the LoRA adapter 'sql'"):
        asyncio.run(run())
