"""python -m tests.lora_tp_probe CHECKPOINT SIZE OUT A B C: LoRA adapters on one engine at a tensor-parallel size.

A process of its own, because torch.distributed is initialised once per process. Adapter A is loaded at
start, B at run time; a batch mixes A, B and the base; then A is unloaded and C loaded at run time into
its freed slot. Writes each run's greedy tokens as JSON.
"""
from __future__ import annotations

import json
import sys

from services.model_worker.config.engine import EngineConfig, SchedulerLimits
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine

LENGTH = 10
PROMPTS = [[5, 17, 300, 41, 9, 88, 120, 3, 77], [400, 2, 19, 250], [33, 61, 7, 7, 7, 90, 11, 205, 13, 500, 1, 64]]
# (prompt index, adapter): the mixed batch, two adapters and the base
MIXED = [(0, ""), (1, "a"), (2, "b"), (0, "a"), (2, ""), (1, "b"), (0, "b")]


def run(engine: LLMEngine, requests: list[tuple[int, str]]) -> list[list[int]]:
    """Greedy tokens of (prompt index, adapter) requests run together."""
    ids = [f"r{i}-{id(requests)}" for i in range(len(requests))]
    for rid, (prompt, adapter) in zip(ids, requests):
        engine.add_request(rid, PROMPTS[prompt], SamplingParams(temperature=0.0, max_tokens=LENGTH, ignore_eos=True),
                           adapter=adapter)
    out = {rid: [] for rid in ids}
    while engine.has_work():
        for step in engine.step():
            out[step.request_id].append(step.token_id)
    return [out[rid] for rid in ids]


def probe(checkpoint: str, size: int, folders: dict[str, str]) -> dict:
    engine = LLMEngine(checkpoint, EngineConfig(
        device="cpu", dtype="float32", num_blocks=128, block_size=4, tensor_parallel_size=size, enable_lora=True,
        max_loras=2, max_lora_rank=16, lora_modules=(("a", folders["a"]),), limits=SchedulerLimits(16, 16, 64)))
    try:
        engine.load_adapter("b", folders["b"])
        out = {"mixed": run(engine, MIXED)}
        out["alone"] = {adapter: run(engine, [(0, adapter)])[0] for adapter in ("", "a", "b")}
        engine.unload_adapter("a")
        engine.load_adapter("c", folders["c"])  # the slot A held, cleared and written again
        out["alone"]["c"] = run(engine, [(0, "c")])[0]
        out["after_reload"] = run(engine, [(1, "b"), (1, "c"), (1, "")])
        return out
    finally:
        engine.close()


if __name__ == "__main__":
    checkpoint, size, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    result = probe(checkpoint, size, dict(zip("abc", sys.argv[4:7])))
    with open(path, "w") as f:
        json.dump(result, f)
