"""The GPU memory a step needs on top of the weights, measured by running the largest one."""
from __future__ import annotations

import torch

from services.model_worker.attention import default_backend
from services.model_worker.config import Qwen3Config
from services.model_worker.kv_cache import KVCache
from services.model_worker.memory import GpuMemory
from services.model_worker.model_runner import ModelRunner
from services.model_worker.sampler import Sampler
from services.model_worker.sampling_params import SamplingParams
from services.model_worker.scheduler import SchedulerLimits
from services.model_worker.step_inputs import StepInputs


@torch.inference_mode()
def profile_step_memory(model, sampler: Sampler, config: Qwen3Config, device: torch.device, dtype: torch.dtype,
                        block_size: int, limits: SchedulerLimits) -> GpuMemory:
    """A prefill of max_num_batched_tokens tokens, then logits and a top-p draw for max_num_seqs rows.

    Top-p sorts the whole vocabulary per row: the sampler's most memory-hungry path.
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    tokens = limits.max_num_batched_tokens
    num_blocks = -(-tokens // block_size)
    cache = KVCache(config, num_blocks, block_size, dtype, device)  # just big enough for the warm-up
    cache_bytes = torch.cuda.memory_allocated(device) - weights
    runner = ModelRunner(model, cache, device, default_backend(device))
    host = StepInputs.build([[0] * tokens], [list(range(num_blocks))], [tokens], block_size)
    hidden = runner.forward(host)
    logits = model.compute_logits(hidden.expand(limits.max_num_seqs, -1))
    logits = logits.float() if logits is not None else None
    if logits is not None:  # None on tensor-parallel ranks other than 0, which never sample
        params = [SamplingParams(temperature=1.0, top_p=0.9, logprobs=20)] * limits.max_num_seqs
        none = torch.empty(0, dtype=torch.long, device=device)
        sampler(logits, params, [none] * len(params), [none] * len(params), [None] * len(params))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights - cache_bytes
    del cache, runner, hidden, logits
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemory(total=total, free=free, weights=weights, peak_activations=peak)
