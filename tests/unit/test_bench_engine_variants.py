"""bench_engine_variants in its quick mode: the report's figures, token checks and speculation counts."""
from __future__ import annotations

import json

import pytest
import torch

from bench.bench_engine_variants import main


@pytest.fixture(autouse=True)
def keep_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_async_scheduling_off_and_on_give_the_same_tokens_at_one_and_several_streams(capsys):
    report = main(["--compare", "async", "--quick", "--streams", "1,3", "--require-identical"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(report))
    assert report["variants"] == ["off", "on"] and list(report["results"]) == ["1", "3"]
    assert report["settings"]["rounds"] == 1  # --quick
    for n, res in report["results"].items():
        assert res["identical_streams_per_round"] == {"on": [int(n)]}
        assert res["shortest_agreeing_prefix"] == {"on": report["settings"]["new_tokens"]}
        assert res["unit"] == ("decode tok/s" if n == "1" else "output tok/s")
        # One round: the ratio is that round's, on over off.
        assert res["ratio_vs_first"]["on"] == pytest.approx(res["tps"]["on"]["median"] / res["tps"]["off"]["median"])
    assert report["speculation"] == {}


def test_different_tokens_fail_the_run_after_the_report(capsys):
    # fp8 weights move a tiny random model's near-tied logits: its greedy tokens part from bf16's at once.
    with pytest.raises(SystemExit, match=r"tokens differ from bf16's: fp8 at 1 stream\(s\), fp8\+head at 1"):
        main(["--compare", "fp8", "--quick", "--require-identical"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["variants"] == ["bf16", "fp8", "fp8+head"]
    assert report["results"]["1"]["identical_streams_per_round"] == {"fp8": [0], "fp8+head": [0]}


def test_ngram_speculation_on_a_grounded_prompt_counts_its_proposals():
    report = main(["--compare", "ngram", "--quick"])
    spec = report["speculation"]["ngram"]
    assert 0 < spec["accepted"] <= spec["proposed"]
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["proposed"])
    # Each verification emits its accepted tokens plus one: more than one token a pass once any is accepted.
    assert 1.0 < spec["tokens_per_pass"] <= 1 + report["settings"]["k"]
    assert report["settings"]["prompt_len"] == 8 + 24  # the seed and the grounding, in --quick
