"""The worker's load and prefix-cache contents as a feed: one snapshot, then merged changes, per watcher."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

LOAD_FIELDS = ("running", "waiting", "kv_blocks_used", "kv_blocks_free", "prefix_cache_hit_rate")


@dataclass
class LoadDelta:
    """What a watcher has not seen yet: the latest load, and the cache changes (or the whole cache on reset)."""
    reset: bool
    load: dict
    stored: list[bytes] = field(default_factory=list)
    evicted: list[bytes] = field(default_factory=list)


class Watcher:
    """One reader of the feed. Changes pile up here until it asks, so a slow reader gets fewer, larger deltas."""

    def __init__(self, feed: LoadFeed):
        self.feed = feed
        self.reset = True  # the first delta is a snapshot
        self.pending: dict[bytes, bool] = {}  # hash -> stored (True) or evicted (False), last state wins
        self.sent_load: dict | None = None
        self.closed = False
        self._changed = asyncio.Event()
        self._changed.set()

    def _notify(self) -> None:
        self._changed.set()

    async def next(self) -> LoadDelta | None:
        """The next change; None once the feed has closed."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            if self.closed:
                return None
            load = self.feed.load
            if self.reset:
                self.reset, self.pending, self.sent_load = False, {}, load
                return LoadDelta(True, load, sorted(self.feed.cached))
            if self.pending or load != self.sent_load:
                pending, self.pending, self.sent_load = self.pending, {}, load
                return LoadDelta(False, load, [h for h, s in pending.items() if s],
                                 [h for h, s in pending.items() if not s])

    def close(self) -> None:
        self.closed = True
        self.feed.watchers.discard(self)
        self._changed.set()


class LoadFeed:
    """Mirrors the engine core's cached block hashes and load; fans each change out to its watchers."""

    def __init__(self):
        self.cached: set[bytes] = set()
        self.load: dict = {name: 0 for name in LOAD_FIELDS}
        self.watchers: set[Watcher] = set()
        self.closed = False

    def watch(self) -> Watcher:
        watcher = Watcher(self)
        if self.closed:
            watcher.close()
        else:
            self.watchers.add(watcher)
        return watcher

    def update(self, stats: dict, stored: list[bytes] = (), evicted: list[bytes] = ()) -> None:
        """One engine update: its stats and the hashes its prefix cache gained and lost."""
        self.cached.difference_update(evicted)
        self.cached.update(stored)
        load = {name: stats[name] for name in LOAD_FIELDS}
        if not stored and not evicted and load == self.load:
            return
        self.load = load
        for watcher in self.watchers:
            watcher.pending.update((h, False) for h in evicted)
            watcher.pending.update((h, True) for h in stored)
            watcher._notify()

    def reset(self, stats: dict) -> None:
        """A new engine core, with an empty cache: every watcher starts over from a snapshot."""
        self.cached.clear()
        self.load = {name: stats[name] for name in LOAD_FIELDS}
        for watcher in self.watchers:
            watcher.reset = True
            watcher._notify()

    def close(self) -> None:
        """End every watch, e.g. when the worker starts draining, so its streams do not hold up the stop."""
        self.closed = True
        for watcher in list(self.watchers):
            watcher.close()

    async def aclose(self) -> None:
        """close() as the drain hook of GrpcServer.run_until_signal, which awaits it."""
        self.close()
