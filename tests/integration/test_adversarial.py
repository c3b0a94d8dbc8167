"""The adversarial harness, in its short form, against the real services (the long form: docs/adversarial.md)."""
from bench import adversarial


def test_hostile_requests_hurt_no_one():
    result = adversarial.run(adversarial.parse_args(["--start", "--seconds", "20"]))
    summary = {k: result[k] for k in ("by_attack", "bad_examples", "loop_stalls_over_250ms", "metrics_missing",
                                      "neighbours", "first_broken_neighbour", "health_after", "exited")}
    assert result["requests"] >= len(adversarial.ATTACKS), summary  # every kind was sent at least once
    assert set(result["by_attack"]) == {a.name for a in adversarial.ATTACKS}, summary
    assert result["unclear_statuses"] == 0, summary
    assert result["core_restarts"] == 0, summary
    assert not result["metrics_missing"], summary
    stalls = "\n\n".join(f"{name}: {entry}" for name, entries in result["stalls_logged"].items() for entry in entries)
    assert not any(result["loop_stalls_over_250ms"].values()), f"{result['loop_stalls_over_250ms']}\n{stalls}"
    assert result["neighbours"].get("whole", 0) > 0 and set(result["neighbours"]) == {"whole"}, summary
    assert adversarial.passed(result)
