"""The worker's load feed: a snapshot first, then merged changes, a reset on a new core, an end on drain."""
from __future__ import annotations

import asyncio

from services.model_worker.core.kv_events import LoadFeed

IDLE = {"running": 0, "waiting": 0, "kv_blocks_used": 0, "kv_blocks_free": 10, "prefix_cache_hit_rate": 0.0}


def stats(**changes) -> dict:
    return {**IDLE, "steps": 3, **changes}


def test_snapshot_then_merged_changes():
    async def scenario():
        feed = LoadFeed()
        feed.update(stats(), [b"a", b"b"])
        watcher = feed.watch()
        first = await watcher.next()
        assert first.reset and sorted(first.stored) == [b"a", b"b"] and first.load == IDLE
        # Three steps before the watcher reads again: one delta, each hash in its last state.
        feed.update(stats(running=1), [b"c"])
        feed.update(stats(running=1), [], [b"a", b"c"])
        feed.update(stats(running=2), [b"c", b"d"])
        delta = await watcher.next()
        assert not delta.reset and sorted(delta.stored) == [b"c", b"d"] and delta.evicted == [b"a"]
        assert delta.load["running"] == 2
        # Nothing changed (a step's counter is not load): no message.
        feed.update(stats(running=2, steps=9))
        assert not await _ready(watcher)
        feed.reset(stats())  # the engine core restarted with an empty cache
        delta = await watcher.next()
        assert delta.reset and delta.stored == []
        feed.close()
        assert await watcher.next() is None
        assert await feed.watch().next() is None  # a watch after the drain began ends at once
    asyncio.run(scenario())


async def _ready(watcher) -> bool:
    task = asyncio.ensure_future(watcher.next())
    await asyncio.sleep(0.05)
    done = task.done()
    task.cancel()
    return done
