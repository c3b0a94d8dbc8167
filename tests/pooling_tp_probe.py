"""python -m tests.pooling_tp_probe CHECKPOINT SIZE OUT: pooling requests on an engine of SIZE tensor-parallel ranks,
beside a generating sequence and over chunked prefill; writes their values and the generated ids as JSON.

A process of its own, because torch.distributed is initialised once per process.
"""
from __future__ import annotations

import json
import sys

import torch

from services.model_worker.config.engine import EngineConfig, SchedulerLimits
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.engine.pooling import PoolingParams

YES_NO = (17, 301)


def prompts(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (5, 40, 13, 1)]


def probe(checkpoint: str, size: int) -> dict:
    engine = LLMEngine(checkpoint, EngineConfig(
        device="cpu", dtype="float32", num_blocks=96, block_size=8, tensor_parallel_size=size,
        limits=SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=16)))
    try:
        batch = prompts(engine.config.vocab_size)
        engine.add_request("g", [3, 1, 4, 1, 5], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        generated = []
        for i, prompt in enumerate(batch):
            engine.add_pooling_request(f"e{i}", prompt, PoolingParams.embed())
            engine.add_pooling_request(f"s{i}", prompt, PoolingParams.score(YES_NO))
        values = {}
        while engine.has_work():
            generated += [out.token_id for out in engine.step()]
            values.update((out.request_id, out.values) for out in engine.take_pooled())
        return {"prompts": batch, "values": values, "generated": generated}
    finally:
        engine.close()


if __name__ == "__main__":
    checkpoint, size, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    with open(path, "w") as f:
        json.dump(probe(checkpoint, size), f)
