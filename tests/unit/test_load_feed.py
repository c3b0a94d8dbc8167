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


def test_a_snapshot_of_200000_blocks_reaches_a_client_in_pieces_under_the_message_limit():
    """The first WatchLoad message of a very large cache would exceed gRPC's 4 MiB limit whole."""
    import grpc

    from services.model_worker.server.servicer import ModelWorkerServicer
    from vllm_v0.worker.v1 import worker_pb2, worker_pb2_grpc

    blocks = [i.to_bytes(32, "little") for i in range(200_000)]

    class Engine:
        info = {"block_size": 16}

        def __init__(self):
            self.load_feed = LoadFeed()
            self.load_feed.update(stats(kv_blocks_used=7), blocks)

    async def scenario():
        engine = Engine()
        server = grpc.aio.server()
        worker_pb2_grpc.add_ModelWorkerServiceServicer_to_server(ModelWorkerServicer("m", engine), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            # The client keeps gRPC's default receive limit of 4 MiB, as the gateway's router does.
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stream = worker_pb2_grpc.ModelWorkerServiceStub(channel).WatchLoad(worker_pb2.WatchLoadRequest())
                updates, received = [], set()
                while len(received) < len(blocks):
                    update = await stream.read()
                    assert update is not grpc.aio.EOF, [u.ByteSize() for u in updates]
                    updates.append(update)
                    received.update(update.stored_block_hashes)
                engine.load_feed.update(stats(kv_blocks_used=7), [b"x" * 32], [blocks[0]])
                after = await stream.read()
                stream.cancel()
        finally:
            await server.stop(None)
        return updates, received, after

    updates, received, after = asyncio.run(scenario())
    assert received == set(blocks)
    assert len(updates) > 1 and all(u.ByteSize() < 4 << 20 for u in updates)
    assert [u.reset for u in updates] == [True] + [False] * (len(updates) - 1)
    assert all(u.kv_blocks_used == 7 and u.block_size == 16 for u in updates)
    assert not after.reset and list(after.stored_block_hashes) == [b"x" * 32]
    assert list(after.evicted_block_hashes) == [blocks[0]]
