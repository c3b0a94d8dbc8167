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
