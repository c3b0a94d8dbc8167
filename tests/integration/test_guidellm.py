"""guidellm, a real outside benchmark client, against the HTTP API.

Beyond its target and data it gets only what its `run` command requires of every server: a profile
(here one request at a time) and, to keep it short, a request count. Nothing tells it about this server:
it finds the model id, the tokenizer (the checkpoint folder that id names) and the routes by itself.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys


REQUESTS = 6


def test_guidellm_benchmarks_the_http_api_with_target_and_data_only(stack, checkpoint, tmp_path):
    guidellm = shutil.which("guidellm", path=os.path.dirname(sys.executable))
    assert guidellm, "guidellm is in requirements-dev.txt"
    run = subprocess.run(
        [guidellm, "run", "--backend", f"kind=openai_http,target={stack.http_url}",
         "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
         "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={REQUESTS}",
         "--output", f"kind=json,path={tmp_path / 'report.json'}", "--disable-progress"],
        cwd=checkpoint.parent, capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (benchmark,) = json.loads((tmp_path / "report.json").read_text())["benchmarks"]
    state = benchmark["scheduler_state"]
    assert (state["successful_requests"], state["errored_requests"]) == (REQUESTS, 0)
    done = benchmark["requests"]["successful"]
    # Its own tokenizer counted our streamed text: the 8 tokens asked for, each its own stream event.
    assert [r["output_tokens"] for r in done] == [8] * REQUESTS
    assert all(r["time_to_first_token_ms"] > 0 and r["output"] for r in done)
