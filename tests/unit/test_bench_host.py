"""The host-overhead benchmark: its decode figures from a step log, and its quick mode on its own tiny checkpoint."""
from __future__ import annotations

import json

import pytest
import torch

from bench.bench_host import main
from bench.host_runs import PHASE_MODEL, decode_figures


def test_decode_steps_are_those_after_every_stream_has_its_first_token():
    # 4 streams whose prompts prefill over two steps; then two decode steps of 4 tokens each.
    steps = [(1.0, 2, 2), (1.5, 4, 2), (2.0, 4, 0), (3.0, 4, 0)]
    figures = decode_figures(0.5, steps, streams=4, expected_tokens=14)
    assert figures["steps"] == 2
    assert figures["tok_s"] == pytest.approx(8 / 1.5)
    assert figures["ms_step"] == pytest.approx(750.0)
    assert figures["us_seq"] == pytest.approx(1.5 / 8 * 1e6)
    assert figures["whole_tok_s"] == pytest.approx(14 / 2.5)


def test_a_run_short_of_its_tokens_is_an_error_not_a_figure():
    with pytest.raises(RuntimeError, match="3 of 4 tokens"):
        decode_figures(0.0, [(1.0, 2, 2), (2.0, 1, 0)], streams=2, expected_tokens=4)
    with pytest.raises(RuntimeError, match="1 of 2 streams"):
        decode_figures(0.0, [(1.0, 1, 1), (2.0, 1, 0)], streams=2, expected_tokens=2)


def test_quick_mode_reports_every_figure(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        line = main(["--quick", "--checkpoint-dir", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(line))
    assert line["vllm"] == {} and line["shape"]["head_dim"] == 16
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == 512
    for workload in ("greedy", "sampled"):
        for streams in (1, 8):
            figures = line["results"][workload][streams]
            ours, core = figures["ours"], figures["core"]
            # 16 tokens a stream: the first from the prompt's one step, then 15 decode steps.
            assert ours["steps"] == core["steps"] == 15
            assert ours["ms_step"] == pytest.approx(ours["us_seq"] * streams / 1e3)
            phases = ours["phases_ms"]
            assert PHASE_MODEL in phases and len(phases) >= 2
            assert ours["host_ms"] == pytest.approx(sum(ms for name, ms in phases.items() if name != PHASE_MODEL))
            assert sum(phases.values()) <= ours["ms_step"]
            assert core["socket_ms"] > 0 and core["frame_kb"] > 0
            assert figures["ours_generate"]["whole_tok_s"] > 0 and figures["ratios"] == {}
