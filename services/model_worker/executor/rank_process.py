"""python -m services.model_worker.executor.rank_process: one of tensor-parallel ranks 1..N-1.

Rank 0 (the engine core's executor) starts it. It loads its shard of the model, sizes its KV
cache like rank 0, then runs the forward of every step rank 0 broadcasts until told to stop. Rank 0
alone schedules and samples.
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

import torch

from rpcserver.server import setup_logging
from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.model import Qwen3Config
from services.model_worker.distributed.group import Rendezvous, watch_parent
from services.model_worker.executor.executor import Executor


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.model_worker.executor.rank_process",
                                     description="one tensor-parallel rank; the engine core starts it")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--store", required=True, help="rank 0's rendezvous file")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--config", required=True, help="the EngineConfig as JSON")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker owns shutdown; rank 0 says when to stop
    threading.Thread(target=watch_parent, name="parent-watchdog", daemon=True).start()
    config = EngineConfig.from_dict(json.loads(args.config))
    with torch.inference_mode():
        executor = Executor(args.checkpoint, config, Qwen3Config.from_json(args.checkpoint),
                            rendezvous=Rendezvous(args.rank, args.store))
        executor.serve_steps()
    return 0


if __name__ == "__main__":
    sys.exit(main())
