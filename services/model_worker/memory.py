"""How many KV cache blocks fit on the GPU, from a profiled peak rather than a guess.

The cache gets what is left of the allowed share of the GPU once the weights and the largest
step's activations are counted:  utilization * total - weights - peak activations.  The peak is
measured by a warm-up forward of --max-num-batched-tokens tokens plus a sampler pass over
--max-num-seqs rows (the largest step the scheduler can form), so a full step can never run the
GPU out of memory after the cache has taken the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

from services.model_worker.config import ConfigError

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
