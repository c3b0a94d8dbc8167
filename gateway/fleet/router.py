"""Which worker serves a prompt: plain-Python routing policies over a snapshot of the fleet."""
from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("cache-aware", "least-load", "round-robin")


@dataclass
class WorkerView:
    """What the router needs to know of one serving worker."""
    address: str
    load: int = 0  # requests running plus waiting on it
    blocks: set[bytes] | frozenset[bytes] = field(default_factory=frozenset)  # prefix-cache block hashes it holds

    def matched_blocks(self, hashes: list[bytes]) -> int:
        """How many of the prompt's leading blocks it holds (a chained hash names the whole prefix)."""
        for i, h in enumerate(hashes):
            if h not in self.blocks:
                return i
        return len(hashes)


@dataclass
class RouterConfig:
    policy: str = "cache-aware"
    # A worker keeps its cache affinity unless it is overloaded against the least-loaded one: more
    # than `balance_abs` requests AND more than `balance_rel` times as many. Both, so that neither a
    # busy fleet (large absolute gaps) nor an idle one (large ratios of tiny loads) loses its cache.
    balance_abs: int = 8
    balance_rel: float = 1.5
    # A match shorter than this share of the prompt's blocks counts as a miss: a short shared head
    # (a chat template's first block) must not pull every prompt onto the first worker that saw it.
    min_match: float = 0.5

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"routing must be one of {', '.join(POLICIES)}, got {self.policy!r}")


class Router:
    """Picks a worker per request. Misses and load ties rotate, so an idle fleet spreads its misses."""

    def __init__(self, config: RouterConfig | None = None):
        self.config = config or RouterConfig()
        self._turn = 0

    def pick(self, workers: list[WorkerView], hashes: list[bytes]) -> WorkerView | None:
        """The worker for a prompt with these block hashes; None when no worker serves."""
        if not workers:
            return None
        self._turn += 1
        policy = self.config.policy
        if policy == "round-robin":
            return workers[self._turn % len(workers)]
        if policy == "least-load" or not hashes:
            return self._least_loaded(workers)
        return self._cache_aware(workers, hashes)

    def _least_loaded(self, workers: list[WorkerView]) -> WorkerView:
        least = min(w.load for w in workers)
        tied = [w for w in workers if w.load == least]
        return tied[self._turn % len(tied)]

    def _cache_aware(self, workers: list[WorkerView], hashes: list[bytes]) -> WorkerView:
        least = min(w.load for w in workers)
        cfg = self.config
        # The imbalance guard, per worker: an overloaded worker gets no request by cache affinity.
        eligible = [w for w in workers if w.load - least <= cfg.balance_abs or w.load <= cfg.balance_rel * least]
        matches = {w.address: w.matched_blocks(hashes) for w in eligible}
        best = max(matches.values())
        if best < cfg.min_match * len(hashes) or best == 0:
            return self._least_loaded(workers)  # a miss: spread by load, never by cache size
        holders = [w for w in eligible if matches[w.address] == best]
        return self._least_loaded(holders)
