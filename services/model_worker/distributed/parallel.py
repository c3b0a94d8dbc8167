"""Tensor parallelism inside the model: which rank holds which slice, and the two collectives a layer needs.

Attention heads, KV heads and the MLP's intermediate dimension (each expert's, in a mixture of
experts, whose router is whole on every rank) are split across ranks (column-
parallel qkv_proj and gate_up_proj, row-parallel o_proj and down_proj, one all-reduce after each),
and the vocabulary is split for the embedding and the LM head. The layers that hold the slices
(model/layers/linear.py, embedding.py) read only their rank's part of each checkpoint tensor.

Control data computed on the host (a block count every rank must agree on) goes over a gloo group
of its own, never the device group: on GPUs that is NCCL, which has no CPU tensors, as vLLM keeps
a cpu_group beside its device_group.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from services.model_worker.config.model import ConfigError, Qwen3Config


def _raise(error: Exception) -> None:
    raise error


@dataclass
class TensorParallel:
    """This process's place among the ranks; size 1 makes every collective a no-op."""

    rank: int = 0
    size: int = 1
    # Called with the error when a collective fails (a rank died or timed out); the rank group makes it fatal.
    on_failure: Callable[[Exception], None] = field(default=_raise, repr=False, compare=False)
    # The model's collectives go over device_group (NCCL on GPUs, gloo on CPUs), host tensors over
    # cpu_group (gloo); never the default group, which holds no CPU backend (distributed/group.py).
    device_group: object = field(default=None, repr=False, compare=False)
    cpu_group: object = field(default=None, repr=False, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial results in place (a row-parallel linear's output)."""
        if self.size > 1:
            try:
                dist.all_reduce(x, group=self.device_group)
            except RuntimeError as e:
                self.on_failure(e)
                raise
        return x

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' elementwise maximum, in place (a row-parallel weight's row amax, for its 8-bit scale)."""
        if self.size > 1:
            try:
                dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.device_group)
            except RuntimeError as e:
                self.on_failure(e)
                raise
        return x

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets (rows, vocab) from every rank's (rows, vocab / size) slice; the others get None."""
        if self.size == 1:
            return local
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        try:
            dist.gather(local, parts, dst=0, group=self.device_group)
        except RuntimeError as e:
            self.on_failure(e)
            raise
        return torch.cat(parts, dim=-1) if parts is not None else None

    def min(self, value: int) -> int:
        """The smallest of the ranks' values (e.g. the KV blocks each rank has room for)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.cpu_group)
        except RuntimeError as e:
            self.on_failure(e)
            raise
        return int(tensor.item())


def check_divisible(config: Qwen3Config, size: int) -> None:
    """Refuse a tensor-parallel size that does not split the model evenly, naming the numbers."""
    if size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {size}")
    uneven = [f"{name} ({getattr(config, name)})" for name in
              ("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
               "vocab_size") if getattr(config, name) % size]
    if uneven:
        raise ConfigError(f"tensor parallel size {size} must divide {', '.join(uneven)}: each rank holds an "
                          f"equal share of the heads, KV heads, MLP and vocabulary")


def local_config(config: Qwen3Config, size: int) -> Qwen3Config:
    """The shapes one rank holds: what its KV cache and memory arithmetic are sized by."""
    if size == 1:
        return config
    return replace(config, num_attention_heads=config.num_attention_heads // size,
                   num_key_value_heads=config.num_key_value_heads // size,
                   intermediate_size=config.intermediate_size // size, vocab_size=config.vocab_size // size,
                   moe_intermediate_size=config.moe_intermediate_size // size)
