"""A short chaos run: streams survive SIGKILLs of an engine core, a worker, a tokenizer and the gateway."""
from __future__ import annotations

from bench.chaos import ChaosConfig, run_chaos

# One kill of each kind, in an order that lets each role come back before it is hit again: the engine core goes
# first, while both workers serve (each kill waits for its role to serve whole), and a worker, which takes 5-12 s
# to serve again on 2 busy CPUs, last.
KINDS = ("engine-core", "tokenizer", "gateway", "worker")


def test_streams_survive_a_kill_of_each_kind(checkpoint, tmp_path):
    # 24 s of streams and four kills, one every 3 s (later when its role is still coming back; none in the last
    # 3 s); its table and JSON are in the captured output on failure.
    config = ChaosConfig(streams=6, minutes=0.4, kill_every=3.0, restart_delay=0.5, kinds=KINDS, in_turn=True,
                         seed=5, timeout=60.0, max_tokens=32, max_kills=len(KINDS))
    result = run_chaos(str(checkpoint), str(tmp_path), config)

    assert [row["kind"] for row in result["kills"]] == list(KINDS), f"not every kind was killed: {result['kills']}"
    assert all(row["open"] > 0 for row in result["kills"]), "a kill with no stream open checks nothing"
    assert result["correct"] > 0 and result["left_running"] == []
    broken = {kind: k["broken"] for kind, k in result["by_kind"].items() if kind != "gateway"}
    assert broken == {"worker": 0, "tokenizer": 0, "engine-core": 0}, result["kills"]
    assert result["broken_unattributed"] == 0, result["errors"]
    counts = {name: result[name] for name in ("lost", "duplicated", "reordered", "mismatched", "bad_prefix")}
    assert counts == dict.fromkeys(counts, 0), result["first_bad"]
    for pool in result["workers_at_end"]:
        assert pool is not None and (pool["running"], pool["waiting"], pool["kv_blocks_used"]) == (0, 0, 0), pool
