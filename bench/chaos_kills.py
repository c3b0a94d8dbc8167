"""What each kill of the chaos benchmark did: the streams it broke, their pauses, how soon service came back.

Plain records with no network, so the attribution and pause rules can be checked on their own.
"""
from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("engine-core", "worker", "tokenizer", "gateway")
# A client may start a request again after the gateway it talked to died; after any other kill the
# stack must carry every open stream through, since another process of the same role still serves.
RESTARTABLE = {"gateway"}
PAUSE_WITH_ANOTHER_S = 1.5  # longest pause while another process of the killed role serves
PAUSE_PAST_RESTART_S = 0.5  # ... and past the restart, when none does


@dataclass
class Pause:
    """One stream's longest gap between messages from a kill on: until its next message, and on to `window` s after."""
    last: float       # the stream's latest message (or its call's start) when the kill came
    kill_at: float
    window: float
    longest: float = 0.0
    closed: bool = False
    broken: bool = False  # the stream broke: counted as broken, not as a pause

    def message(self, now: float) -> None:
        if self.closed:
            return
        self.longest = max(self.longest, now - self.last)
        self.last = now
        self.closed = now >= self.kill_at + self.window

    def end(self, broken: bool = False) -> None:
        if not self.closed:
            self.closed, self.broken = True, broken

    def seconds(self, now: float) -> float:
        """The longest gap so far, counting a gap still open at `now`."""
        return self.longest if self.closed else max(self.longest, now - self.last)


@dataclass
class Kill:
    n: int
    kind: str
    target: str           # the process's name; for an engine core, its worker's
    pid: int
    at: float             # time.monotonic() of the kill
    at_s: float           # seconds since the streams started
    others_serving: bool  # another process of the same role served at that moment
    pauses: dict[int, Pause] = field(default_factory=dict)  # stream id -> its pause, for the streams open then
    broken: int = 0
    restarted: int = 0    # streams a client started again (gateway kills only)
    back_at: float | None = None      # when the killed process (a core: its worker) served again
    recovery_at: float | None = None  # when a request started after the kill first ended correctly
    orphans: int = 0      # processes it left behind (a worker's engine core), found still running

    @property
    def back_s(self) -> float | None:
        return None if self.back_at is None else self.back_at - self.at

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovery_at is None else self.recovery_at - self.at

    def pause_limit(self) -> float | None:
        """The longest pause allowed: 1.5 s while another process of the role serves, else the restart plus 0.5 s."""
        if self.others_serving:
            return PAUSE_WITH_ANOTHER_S
        return None if self.back_s is None else self.back_s + PAUSE_PAST_RESTART_S

    def pauses_s(self, now: float) -> list[float]:
        """The pauses of the streams it affected and did not break."""
        return [p.seconds(now) for p in self.pauses.values() if not p.broken]

    def row(self, now: float) -> dict:
        pauses, limit = self.pauses_s(now), self.pause_limit()
        over = len(pauses) if limit is None else sum(p > limit for p in pauses)
        return {"n": self.n, "kind": self.kind, "target": self.target, "pid": self.pid, "at_s": round(self.at_s, 2),
                "open": len(self.pauses), "broken": self.broken, "restarted": self.restarted,
                "max_pause_s": round(max(pauses, default=0.0), 3), "pause_limit_s": _round(limit),
                "pauses_over_limit": over, "others_serving": self.others_serving, "back_s": _round(self.back_s),
                "recovery_s": _round(self.recovery_s), "orphans": self.orphans}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


class KillLog:
    """Every kill so far, and which of them a failed stream is blamed on."""

    def __init__(self, within_s: float):
        self.within_s = within_s
        self.kills: list[Kill] = []

    def add(self, kill: Kill) -> None:
        self.kills.append(kill)

    def blame(self, now: float, opened_at: float) -> Kill | None:
        """The latest kill before `now`, if the stream was open at it or it came at most `within_s` before;
        a gateway kill holds the blame until `within_s` after the gateway serves again."""
        kill = next((k for k in reversed(self.kills) if k.at <= now), None)
        if kill is None:
            return None
        if kill.kind in RESTARTABLE and (kill.back_at is None or now <= kill.back_at + self.within_s):
            return kill
        return kill if kill.at >= opened_at or now - kill.at <= self.within_s else None

    def recovered(self, now: float, started_at: float) -> None:
        """A request started at `started_at` ended correctly at `now`: the kills before its start are over."""
        for kill in self.kills:
            if kill.recovery_at is None and kill.at <= started_at:
                kill.recovery_at = now


def by_kind(rows: list[dict]) -> dict[str, dict]:
    """Per kind of kill: how many, the streams open, broken and started again, the longest pause, pauses over limit."""
    kinds = {}
    for row in rows:
        k = kinds.setdefault(row["kind"], {"kills": 0, "open": 0, "broken": 0, "restarted": 0, "max_pause_s": 0.0,
                                           "pauses_over_limit": 0, "max_back_s": 0.0})
        k["kills"] += 1
        for name in ("open", "broken", "restarted", "pauses_over_limit"):
            k[name] += row[name]
        k["max_pause_s"] = max(k["max_pause_s"], row["max_pause_s"])
        k["max_back_s"] = max(k["max_back_s"], row["back_s"] or 0.0)
    return kinds


def failures(result: dict) -> list[str]:
    """Each target the run missed, in words; none means it passed."""
    missed = []
    for kind, k in result["by_kind"].items():
        if kind not in RESTARTABLE and k["broken"]:
            missed.append(f"{k['broken']} streams broken by {kind} kills")
        if k["pauses_over_limit"]:
            missed.append(f"{k['pauses_over_limit']} streams paused past the limit after {kind} kills")
    if result["broken_unattributed"]:
        missed.append(f"{result['broken_unattributed']} streams broken with no kill to blame")
    for name in ("lost", "duplicated", "reordered", "mismatched", "bad_prefix"):
        if result[name]:
            missed.append(f"{result[name]} streams {name.replace('_', ' ')}")
    for n, pool in enumerate(result["workers_at_end"]):
        if pool is None or pool["running"] or pool["waiting"] or pool["kv_blocks_used"]:
            missed.append(f"worker-{n} not idle with its KV pool free at the end: {pool}")
    if result["left_running"]:
        missed.append(f"processes left running: {result['left_running']}")
    return missed
