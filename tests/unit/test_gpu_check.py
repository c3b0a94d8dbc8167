"""scripts/gpu-check.sh where there is no GPU, and the summary lines it reads from the benchmarks' reports."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_check_summary", ROOT / "scripts" / "gpu_check_summary.py")
gpu_check_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check_summary)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs the whole check")
def test_without_a_gpu_it_stops_at_once_and_says_why(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_LOG_DIR": str(tmp_path)}
    env.pop("GPU_CHECK_DEVICE", None)
    result = subprocess.run(["bash", "scripts/gpu-check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "no NVIDIA GPU is visible to torch" in result.stderr
    assert "GPU_CHECK_DEVICE=cpu" in result.stderr
    assert list(tmp_path.iterdir()) == []  # no step ran


def median(value: float) -> dict:
    return {"median": value, "min": value, "max": value, "n": 1}


def test_engine_line_has_single_stream_and_concurrent_figures(tmp_path):
    report = {"settings": {"streams": 64}, "results": {"bfloat16": {
        "figures": {"ours_decode_tps": median(512.4), "transformers_decode_tps": median(80.0),
                    "ours_streams_output_tps": median(12345.0), "transformers_streams_output_tps": median(2500.0)},
        "ratios": {"decode_speedup_vs_transformers": 6.405}}}}
    assert gpu_check_summary.engine(report) == ("1 stream: ours 512 tok/s, transformers 80 (6.4x); "
                                                "64 streams: ours 12345 output tok/s, transformers 2500")


def test_services_line_and_a_log_without_a_report(tmp_path, capsys, monkeypatch):
    report = {"results": {"gateway": {"decode_tok_s": median(401.0)}, "transformers": {"decode_tok_s": median(75.2)}}}
    assert gpu_check_summary.services(report) == "gateway 401, transformers 75 decode tok/s, 1 stream"
    log = tmp_path / "services.log"
    log.write_text("Traceback (most recent call last):\n  ...\nTimeoutError: worker not serving\n")
    monkeypatch.setattr(sys, "argv", ["gpu_check_summary.py", "services", str(log)])
    gpu_check_summary.main()
    assert capsys.readouterr().out.strip() == "no report (see the log)"
    log.write_text("figures\n" + json.dumps(report) + "\n")
    gpu_check_summary.main()
    assert capsys.readouterr().out.strip() == "gateway 401, transformers 75 decode tok/s, 1 stream"


def test_engine_line_judges_the_goals_where_a_gpu_run_measured_them():
    report = {"settings": {"device": "cuda", "streams": 256, "short_context": 64, "long_context": 16384},
              "results": {"bfloat16": {
                  "figures": {"ours_decode_tps": median(1100.0), "transformers_decode_tps": median(100.0),
                              "ours_streams_output_tps": median(39000.0),
                              "transformers_streams_output_tps": median(3000.0),
                              "ours_ms_per_token_ctx_short": median(0.91), "ours_ms_per_token_ctx_long": median(1.1)},
                  "ratios": {"decode_speedup_vs_transformers": 11.0, "ctx2048_vs_ctx64_time_per_token": 1.21}}}}
    assert gpu_check_summary.engine(report) == (
        "1 stream: ours 1100 tok/s (goal >= 1000: met), transformers 100 (11.0x); "
        "256 streams: ours 39000 output tok/s (goal >= 40000: MISSED), transformers 3000; "
        "ms a token at context 64 / 16384: 0.91 / 1.10 (1.21x, goal <= 1.3: met)")
    # Another stream count or context than the goals', or a CPU run: the figures without a verdict.
    report["settings"].update(streams=64, long_context=2048)
    assert "goal" not in gpu_check_summary.engine(report).split("; ", 1)[1]
    report["settings"]["device"] = "cpu"
    assert "goal" not in gpu_check_summary.engine(report)


def variants_report(identical_at_64: list[int]) -> dict:
    def figures(off: float, on: float, identical: list[int], unit: str) -> dict:
        return {"unit": unit, "tps": {"off": median(off), "on": median(on)}, "ratio_vs_first": {"on": on / off},
                "identical_streams_per_round": {"on": identical}}
    return {"variants": ["off", "on"], "speculation": {}, "results": {
        "1": figures(800.0, 1000.0, [1, 1, 1], "decode tok/s"),
        "64": figures(30000.0, 33000.0, identical_at_64, "output tok/s")}}


def test_variants_line_and_a_report_followed_by_the_failed_check(tmp_path, capsys, monkeypatch):
    assert gpu_check_summary.variants(variants_report([64, 64, 64])) == (
        "1 stream: off 800, on 1000 decode tok/s (on/off 1.25x, 3/3 streams' tokens identical); "
        "64 streams: off 30000, on 33000 output tok/s (on/off 1.10x, 192/192 streams' tokens identical)")
    speculative = {"variants": ["plain", "ngram"], "results": {"1": {
        "unit": "decode tok/s", "tps": {"plain": median(900.0), "ngram": median(2000.0)},
        "ratio_vs_first": {"ngram": 2.2}, "identical_streams_per_round": {"ngram": [0, 1]}}},
        "speculation": {"ngram": {"tokens_per_pass": 3.14, "acceptance_rate": 0.535}}}
    assert gpu_check_summary.variants(speculative) == (
        "1 stream: plain 900, ngram 2000 decode tok/s (ngram/plain 2.20x, 1/2 streams' tokens identical); "
        "ngram: 3.14 tokens a pass, acceptance 0.54")
    log = tmp_path / "async.log"
    log.write_text("rounds\n" + json.dumps(variants_report([64, 63, 64])) + "\ntokens differ from off's: on at 64\n")
    monkeypatch.setattr(sys, "argv", ["gpu_check_summary.py", "variants", str(log)])
    gpu_check_summary.main()
    assert "191/192 streams' tokens identical" in capsys.readouterr().out
