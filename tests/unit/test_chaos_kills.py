"""The chaos benchmark's rules: which kill a failed stream is blamed on, how pauses and their limits are taken."""
from bench.chaos_kills import Kill, KillLog, Pause, by_kind, failures


def kill(n: int, kind: str, at: float, others: bool = True, back_at: float | None = None) -> Kill:
    return Kill(n, kind, f"{kind}-0", 100 + n, at, at, others, back_at=back_at)


def test_a_failure_is_blamed_on_the_latest_kill_when_recent_or_open_at_it():
    log = KillLog(within_s=5)
    log.add(kill(1, "worker", at=10))
    log.add(kill(2, "tokenizer", at=20))
    assert log.blame(now=9, opened_at=0) is None            # before any kill
    assert log.blame(now=14, opened_at=12).n == 1           # within 5 s of kill 1
    assert log.blame(now=19, opened_at=16) is None          # 9 s after kill 1, opened after it
    assert log.blame(now=19, opened_at=8).n == 1            # open at kill 1
    assert log.blame(now=21, opened_at=8).n == 2            # the latest kill, never an earlier one


def test_a_gateway_kill_holds_the_blame_until_shortly_after_it_serves_again():
    log = KillLog(within_s=2)
    gateway = kill(1, "gateway", at=10, others=False)
    log.add(gateway)
    assert log.blame(now=30, opened_at=25) is gateway       # not back yet
    gateway.back_at = 31
    assert log.blame(now=32.5, opened_at=32) is gateway
    assert log.blame(now=34, opened_at=33) is None


def test_a_pause_spans_the_kill_and_runs_on_to_the_window_then_stops():
    pause = Pause(last=9.9, kill_at=10, window=2)
    assert pause.seconds(now=10.5) == 10.5 - 9.9            # still waiting for the next message
    pause.message(11.4)                                      # the gap across the kill: 1.5 s
    pause.message(11.6)
    pause.message(14.6)                                      # ends past the window: still counted, then closed
    pause.message(20.0)
    assert pause.closed and pause.seconds(now=99) == 3.0


def test_pause_limits_and_the_targets_missed():
    worker = kill(1, "worker", at=10, back_at=20)
    worker.pauses = {1: Pause(9.9, 10, 5, longest=1.4, closed=True), 2: Pause(9.9, 10, 5, longest=1.6, closed=True),
                     3: Pause(9.9, 10, 5, longest=9.0, closed=True, broken=True)}
    worker.broken = 1
    gateway = kill(2, "gateway", at=30, others=False, back_at=32)
    gateway.pauses = {4: Pause(29.9, 30, 5, longest=2.4, closed=True)}
    gateway.restarted = 1
    rows = [worker.row(now=40), gateway.row(now=40)]
    assert rows[0]["pause_limit_s"] == 1.5 and rows[0]["pauses_over_limit"] == 1 and rows[0]["max_pause_s"] == 1.6
    assert rows[1]["pause_limit_s"] == 2.5 and rows[1]["pauses_over_limit"] == 0
    result = {"by_kind": by_kind(rows), "broken_unattributed": 0, "lost": 0, "duplicated": 1, "reordered": 0,
              "mismatched": 0, "bad_prefix": 0, "left_running": [],
              "workers_at_end": [{"running": 0, "waiting": 0, "kv_blocks_used": 0},
                                 {"running": 0, "waiting": 0, "kv_blocks_used": 3}]}
    missed = failures(result)
    assert missed[:3] == ["1 streams broken by worker kills", "1 streams paused past the limit after worker kills",
                          "1 streams duplicated"]
    assert len(missed) == 4 and missed[3].startswith("worker-1 not idle")


def test_a_gateway_that_never_came_back_fails_every_pause():
    gateway = kill(1, "gateway", at=30, others=False)
    gateway.pauses = {1: Pause(29.9, 30, 5, longest=0.1, closed=True)}
    assert gateway.row(now=40)["pauses_over_limit"] == 1
