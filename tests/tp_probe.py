"""python -m tests.tp_probe CHECKPOINT SIZE OUT [QUANTIZATION]: run one engine at a tensor-parallel size and write what it computed.

A process of its own, because torch.distributed is initialised once per process; the tests run it
at size 2 and compare with the same probe at size 1 and with transformers.
"""
from __future__ import annotations

import dataclasses
import json
import sys

import torch

from services.model_worker.config.engine import EngineConfig
from services.model_worker.config.engine import SchedulerLimits
from services.model_worker.config.engine import SpeculativeConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from services.model_worker.engine.speculator import Speculator
from services.model_worker.executor.step_inputs import StepInputs

BLOCK_SIZE = 8
# Small enough that a 40-token prompt is prefilled in three chunks and a batch of three in several steps.
MAX_BATCHED_TOKENS = 16


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def probe(checkpoint: str, size: int, quantization: str = "none") -> dict:
    engine = LLMEngine(checkpoint, EngineConfig(
        device="cpu", dtype="float32", num_blocks=96, block_size=BLOCK_SIZE, tensor_parallel_size=size,
        quantization=quantization,
        limits=SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=MAX_BATCHED_TOKENS)))
    try:
        vocab = engine.config.vocab_size
        greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
        # Logits of every row of one 37-token prefill, straight through the runner (rank 0 broadcasts it).
        first = prompt(37, 1, vocab)
        host = StepInputs.build([first], [list(range(5))], [37], BLOCK_SIZE)
        host.sample_rows = torch.arange(37)
        with torch.inference_mode():
            logits = engine.model.compute_logits(engine.runner.forward(host))
        long_prompt = prompt(40, 3, vocab)
        out = {
            "logits": logits.tolist(),
            "greedy": engine.generate([prompt(11, 2, vocab)], greedy(32))[0],
            "batched": engine.generate([prompt(n, 30 + n, vocab) for n in (3, 17, 9)], greedy(12)),
            "chunked": engine.generate([long_prompt], greedy(8))[0],
        }
        hits = engine.block_manager.prefix_hits
        out["prefix_hit"] = engine.generate([long_prompt[:32] + prompt(5, 4, vocab)], greedy(8))[0]
        out["prefix_hits"] = engine.block_manager.prefix_hits - hits
        # Speculative decoding (prompt lookup) on the same ranks: verification steps broadcast like any other.
        seed = prompt(6, 5, vocab)
        looped = seed + engine.generate([seed], greedy(24))[0]
        out["plain_after_loop"] = engine.generate([looped, prompt(9, 6, vocab)], greedy(16))
        engine_plain = engine.generate([prompt(9, 6, vocab), prompt(14, 7, vocab)], greedy(16))
        engine.speculator = Speculator(SpeculativeConfig("ngram", ngram_min=1))
        out["speculative"] = engine.generate([looped, prompt(9, 6, vocab)], greedy(16))
        out["spec_counts"] = [engine.speculator.num_proposed, engine.speculator.num_accepted]
        # A draft model (here the checkpoint itself, so every proposal is right) whole on rank 0.
        drafting = dataclasses.replace(engine.engine_config, speculative=SpeculativeConfig(
            "draft", draft_model=checkpoint, num_speculative_tokens=3, fixed_k=True))
        engine.speculator = Speculator(drafting.speculative, engine._draft_proposer(drafting))
        out["draft"] = engine.generate([prompt(9, 6, vocab), prompt(14, 7, vocab)], greedy(16))
        out["plain_draft_prompts"] = engine_plain
        out["draft_counts"] = [engine.speculator.num_proposed, engine.speculator.num_accepted]
        return out
    finally:
        engine.close()


if __name__ == "__main__":
    checkpoint, size, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    result = probe(checkpoint, size, *sys.argv[4:5])
    with open(path, "w") as f:
        json.dump(result, f)
