"""The routing policies on a fake fleet: cache affinity, the imbalance guard, misses by load, leave and rejoin."""
from __future__ import annotations

import asyncio
import logging
from collections import Counter

import pytest

from gateway.fleet.block_hash import prompt_block_hashes
from gateway.fleet.router import Router, RouterConfig, WorkerView
from gateway.fleet.workers import SERVING, UNREACHABLE, Fleet, Worker
from vllm_v0.worker.v1 import worker_pb2

BS = 4


def prompt(group: int, turn: int, length: int = 40) -> list[int]:
    """A shared prefix per group (36 tokens = 9 blocks) and a short turn of its own."""
    return [1000 * group + i for i in range(length - 4)] + [7, 7, turn, turn]


class FakeFleet:
    """Workers that cache every prompt routed to them and carry a load the test sets."""

    def __init__(self, names, config=None):
        self.router = Router(config)
        self.workers = {n: WorkerView(n, 0, set()) for n in names}
        self.up = set(names)

    def route(self, ids: list[int], cache: bool = True) -> str:
        views = [w for n, w in self.workers.items() if n in self.up]
        chosen = self.router.pick(views, prompt_block_hashes(ids, BS))
        if cache:
            chosen.blocks.update(prompt_block_hashes(ids + [0], BS))  # the worker caches what it computed
        return chosen.address


def test_same_prefix_same_worker():
    fleet = FakeFleet(["a", "b", "c"])
    homes = {g: fleet.route(prompt(g, 0)) for g in range(3)}
    assert len(set(homes.values())) == 3  # three first misses on an idle fleet go to three workers
    for turn in range(1, 20):
        for g in range(3):
            assert fleet.route(prompt(g, turn)) == homes[g]


def test_misses_spread_by_load_not_cache_size():
    fleet = FakeFleet(["a", "b"])
    for g in range(5):  # a holds much more cache than b
        fleet.workers["a"].blocks.update(prompt_block_hashes(prompt(g, 0) + [0], BS))
    fleet.workers["a"].load, fleet.workers["b"].load = 1, 3
    assert fleet.route(prompt(99, 0), cache=False) == "a"  # the larger cache, but the shorter queue
    fleet.workers["a"].load = 4
    assert fleet.route(prompt(98, 0), cache=False) == "b"


def test_misses_rotate_when_loads_tie():
    fleet = FakeFleet(["a", "b", "c"])
    chosen = Counter(fleet.route(prompt(g, 0), cache=False) for g in range(30))
    assert chosen == {"a": 10, "b": 10, "c": 10}


def test_short_shared_head_is_a_miss():
    # Every prompt starts with the same 1-block header (a chat template's): that must not pin them to one worker.
    fleet = FakeFleet(["a", "b"])
    chosen = Counter(fleet.route([5, 5, 5, 5] + [100 * g + i for i in range(20)], cache=True) for g in range(10))
    assert chosen == {"a": 5, "b": 5}


def test_imbalance_guard():
    config = RouterConfig(balance_abs=8, balance_rel=1.5)
    fleet = FakeFleet(["a", "b"], config)
    home = fleet.route(prompt(1, 0))
    other = "b" if home == "a" else "a"
    fleet.workers[home].load, fleet.workers[other].load = 8, 0  # 8 more, but within balance_abs: affinity holds
    assert fleet.route(prompt(1, 1)) == home
    fleet.workers[home].load, fleet.workers[other].load = 30, 25  # 5 more: within balance_abs
    assert fleet.route(prompt(1, 2)) == home
    fleet.workers[home].load, fleet.workers[other].load = 40, 20  # 20 more and twice as many: overloaded
    assert fleet.route(prompt(1, 3), cache=False) == other
    fleet.workers[home].load, fleet.workers[other].load = 9, 0
    assert fleet.route(prompt(1, 4), cache=False) == other


def test_longest_match_wins():
    fleet = FakeFleet(["a", "b"])
    ids = prompt(1, 0)
    hashes = prompt_block_hashes(ids, BS)
    fleet.workers["a"].blocks.update(hashes[:6])
    fleet.workers["b"].blocks.update(hashes[:9])
    fleet.workers["b"].load = 2
    assert fleet.route(ids, cache=False) == "b"


@pytest.mark.parametrize("policy", ["round-robin", "least-load"])
def test_other_policies_ignore_the_cache(policy):
    fleet = FakeFleet(["a", "b"], RouterConfig(policy))
    chosen = Counter(fleet.route(prompt(1, t)) for t in range(10))
    assert chosen == {"a": 5, "b": 5}
    fleet.workers["a"].load = 3
    chosen = Counter(fleet.route(prompt(1, t)) for t in range(10, 14))
    assert chosen == ({"b": 4} if policy == "least-load" else {"a": 2, "b": 2})


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="routing must be one of"):
        RouterConfig("random")


def test_fleet_leave_and_rejoin():
    """The gateway's Fleet: a worker that stops serving leaves the rotation and keeps nothing; back, it rejoins."""
    async def scenario():
        fleet = Fleet(["a:1", "b:2"], open_channel=lambda address: None, interval=1.0, router=Router())
        for address in ("a:1", "b:2"):
            worker = Worker(address, _NoChannel(), 1.0)
            worker.state, worker.block_size = SERVING, BS
            fleet.workers[address] = worker
        ids = prompt(1, 0)
        fleet.workers["b:2"].apply(worker_pb2.LoadUpdate(reset=True, block_size=BS,
                                                          stored_block_hashes=prompt_block_hashes(ids, BS)))
        assert [fleet.pick(ids).address for _ in range(4)] == ["b:2"] * 4
        fleet.workers["b:2"].apply(worker_pb2.LoadUpdate(evicted_block_hashes=prompt_block_hashes(ids, BS)[5:],
                                                          block_size=BS))
        assert len(fleet.workers["b:2"].blocks) == 5
        fleet.workers["b:2"].state = UNREACHABLE
        assert {fleet.pick(ids).address for _ in range(4)} == {"a:1"}
        assert fleet.pick(ids, exclude=("a:1",)) is None
        fleet.workers["b:2"].state = SERVING
        assert {fleet.pick(prompt(g, 0)).address for g in range(4)} == {"a:1", "b:2"}
    asyncio.run(scenario())


def test_a_removed_worker_is_retired_by_a_task_the_fleet_holds_and_closes():
    """A worker that leaves the DNS answer keeps its channel while it has streams; the fleet holds that wait
    and, closing, ends it and the channel too."""
    async def scenario():
        fleet = Fleet(["a:1"], open_channel=lambda address: None, interval=0.01, router=Router())
        channels = {address: _NoChannel() for address in ("a:1", "b:2", "c:3")}
        for address, channel in channels.items():
            fleet.workers[address] = Worker(address, channel, 0.01)
        fleet.workers["b:2"].in_flight = 1
        fleet.workers["c:3"].in_flight = 1
        retiring = fleet.workers["c:3"]
        await fleet._resolve()  # b:2 and c:3 are no longer among the targets
        assert list(fleet.workers) == ["a:1"]
        assert not channels["b:2"].closed and not channels["c:3"].closed  # each still has a stream
        retiring.in_flight = 0
        for _ in range(100):
            await asyncio.sleep(0.01)
            if channels["c:3"].closed:
                break
        assert channels["c:3"].closed  # its stream ended: closed by the task
        assert not channels["b:2"].closed
        await fleet.close()
        assert channels["a:1"].closed and channels["b:2"].closed  # b:2's stream never ended: closed with the fleet
        assert not asyncio.all_tasks() - {asyncio.current_task()}  # nothing left running
    asyncio.run(scenario())


def test_a_name_that_does_not_resolve_keeps_its_workers_and_is_reported_once(caplog):
    """A headless Service with no ready pod has no address: the gateway keeps what it had and says so once,
    not at every lookup."""
    async def scenario():
        target = "dns:///no-worker-is-ready.invalid:50053"  # .invalid never resolves (RFC 2606)
        fleet = Fleet([target], open_channel=lambda address: None, interval=0.01, router=Router())
        fleet.workers["10.0.0.7:50053"] = Worker("10.0.0.7:50053", _NoChannel(), 0.01)
        with caplog.at_level(logging.WARNING, logger="gateway.fleet.members"):
            for _ in range(3):
                await fleet._resolve()
        assert list(fleet.workers) == ["10.0.0.7:50053"]
        assert [r.getMessage().split(" (")[0] for r in caplog.records] == [f"cannot resolve {target}"]
        await fleet.close()
    asyncio.run(scenario())


class _NoChannel:
    closed = False

    def unary_unary(self, *args, **kwargs):
        return None

    async def close(self):
        self.closed = True

    unary_stream = stream_unary = stream_stream = unary_unary
