"""How many KV cache blocks fit: on a GPU from a profiled peak rather than a guess, on a CPU from a byte budget.

On a GPU the cache gets what is left of the allowed share of the GPU once the weights and the largest
step's activations are counted:  utilization * total - weights - peak activations.  The peak is
measured by a warm-up forward of --max-num-batched-tokens tokens, a sampler pass over --max-num-seqs
rows, and the prompt-logprobs scoring of a chunk whose every row is a scored prompt position (logits
for --max-num-batched-tokens rows: about 620 MB in bf16 at 2,048 rows of Qwen3's vocabulary): the
largest step the scheduler can form, so a full step can never run the GPU out of memory after the
cache has taken the rest. The sampler pass is penalised, over the penalty state's rows (penalty_state.py: 5
bytes a slot and token, 194 MB at 256 slots of Qwen3's vocabulary), which the engine allocates at its first
penalised step and keeps: the peak counts them and the gathers a penalised step makes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.model_worker.config.engine import SchedulerLimits
from services.model_worker.config.model import ConfigError, Qwen3Config
from services.model_worker.config.sampling import MAX_LOGPROBS, SamplingParams
from services.model_worker.executor.kv_cache import KVCache
from services.model_worker.executor.model_runner import ModelRunner
from services.model_worker.executor.penalty_state import PenaltyRows, allocate_rows
from services.model_worker.executor.prompt_logprobs import score_rows
from services.model_worker.executor.sampler import Sampler
from services.model_worker.executor.step_inputs import StepInputs
from services.model_worker.model.layers.attention.device_backend import default_backend

GIB = 1 << 30


@dataclass
class GpuMemory:
    total: int            # bytes on the device
    free: int             # bytes free on the device now (other processes' use is not ours to take)
    weights: int          # bytes this process holds before the cache (weights, buffers)
    peak_activations: int  # bytes a full step needs on top of that, measured


@dataclass
class KVPlan:
    num_blocks: int
    budget: int  # bytes the cache may take
    summary: str


def plan_kv_cache(memory: GpuMemory, utilization: float, bytes_per_block: int, block_size: int,
                  max_model_len: int, max_num_seqs: int) -> KVPlan:
    """The block count for the cache; refuses (ConfigError) when not even one full-length sequence fits."""
    if not 0 < utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    allowed = int(utilization * memory.total)
    budget = allowed - memory.weights - memory.peak_activations
    # Other processes on the GPU: never plan for more than is actually free now.
    budget = min(budget, memory.free - memory.peak_activations)
    needed = -(-max_model_len // block_size)  # blocks for one sequence of max_model_len tokens
    num_blocks = max(budget, 0) // bytes_per_block
    sizes = (f"{utilization:g} x {memory.total / GIB:.1f} GiB = {allowed / GIB:.2f} GiB allowed, "
             f"weights {memory.weights / GIB:.2f} GiB, peak activations {memory.peak_activations / GIB:.2f} GiB, "
             f"{memory.free / GIB:.2f} GiB free")
    if num_blocks < needed:
        raise ConfigError(
            f"the KV cache would hold {num_blocks * block_size} tokens ({sizes}), fewer than one sequence of "
            f"--max-model-len {max_model_len} tokens needs ({needed * block_size}); raise --gpu-memory-utilization, "
            f"lower --max-model-len or --max-num-batched-tokens, or free the GPU")
    # More than every sequence at full length could use is wasted: small models need far less.
    num_blocks = min(num_blocks, max_num_seqs * needed)
    summary = (f"KV cache sized by profiling: {sizes}: {num_blocks} blocks of {block_size} tokens "
               f"({num_blocks * bytes_per_block / GIB:.2f} GiB, {num_blocks * block_size} tokens)")
    return KVPlan(num_blocks, budget, summary)


def blocks_from_budget(budget_bytes: int, bytes_per_block: int, max_model_len: int, block_size: int,
                       max_num_seqs: int) -> int:
    """CPU: --kv-cache-bytes, at most what every sequence at full length could use."""
    ceiling = max_num_seqs * -(-max_model_len // block_size)
    return max(min(budget_bytes // bytes_per_block, ceiling), 1)


@torch.inference_mode()
def profile_step_memory(model, sampler: Sampler, config: Qwen3Config, device: torch.device, dtype: torch.dtype,
                        block_size: int, limits: SchedulerLimits, max_len: int | None = None,
                        kv_cache_dtype: str = "auto") -> GpuMemory:
    """A prefill of max_num_batched_tokens tokens, then logits and a penalised top-p draw for max_num_seqs rows,
    then prompt logprobs scored over all max_num_batched_tokens rows.

    The prefill is prompts of max_len tokens (the longest a sequence may be; default the model's
    max_position_embeddings) and one with the rest: no position past the rotary table, which on a GPU
    would be a device-side assert that leaves the CUDA context unusable.

    kv_cache_dtype: the cache's format (--kv-cache-dtype); the plan counts its blocks with KVCache.bytes_per_block,
    which holds an 8-bit cache's elements and int8's per-token scales.

    Top-p sorts the whole vocabulary per row: the sampler's most memory-hungry path. The scored rows'
    logits live beside the sampled rows' in a step that both prefills a scored prompt and samples.
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    tokens = limits.max_num_batched_tokens
    max_len = max_len or config.max_position_embeddings
    lengths = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
    tables, num_blocks = [], 0
    for length in lengths:
        used = -(-length // block_size)
        tables.append(list(range(num_blocks, num_blocks + used)))
        num_blocks += used
    # Just big enough for the warm-up, in the cache's own format: an 8-bit one's write and read are part of the step.
    cache = KVCache(config, num_blocks, block_size, dtype, device, kv_cache_dtype=kv_cache_dtype)
    cache_bytes = torch.cuda.memory_allocated(device) - weights
    runner = ModelRunner(model, cache, device, default_backend(device))
    host = StepInputs.build([[0] * length for length in lengths], tables, lengths, block_size)
    hidden = runner.forward(host)
    # A step's logits are one tensor: the scored prompt rows stay alive while the sampler runs.
    scored = model.compute_logits(hidden[:1].expand(tokens, -1))
    logits = model.compute_logits(hidden[:1].expand(limits.max_num_seqs, -1))
    penalties = None
    if logits is not None:  # None on tensor-parallel ranks other than 0, which never sample
        score_rows(scored, [0] * tokens, [MAX_LOGPROBS] * tokens)
        logits = logits.float()
        rows = limits.max_num_seqs
        penalties = PenaltyRows(None, torch.arange(rows, device=device), *allocate_rows(rows, logits.shape[1], device))
        params = [SamplingParams(temperature=1.0, top_p=0.9, logprobs=MAX_LOGPROBS, repetition_penalty=1.1,
                                 presence_penalty=0.5, frequency_penalty=0.5)] * rows
        sampler(logits, params, penalties, [None] * rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights - cache_bytes
    del cache, runner, hidden, logits, scored, penalties
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemory(total=total, free=free, weights=weights, peak_activations=peak)
