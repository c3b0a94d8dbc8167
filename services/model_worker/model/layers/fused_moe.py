"""Mixture-of-experts: the router's top-k choice and the experts' SwiGLU MLPs, all experts in one tensor each.

Every expert's gate and up projections live in one (E, 2 * I, H) tensor (w13) and its down
projection in one (E, H, I) tensor (w2), so a step's tokens are grouped by expert and each
projection is one grouped matmul over those groups, never a Python loop over experts. Which
grouped matmul runs is an `ExpertsKernel`, chosen once for the device after loading
(`process_weights_after_loading`): the C kernel on CPU (kernels/moe.c), the Triton kernel on a
GPU (kernels/triton_moe.py), torch's grouped_mm otherwise. All of them read only the experts
that some token chose.

How the experts' weights are held is an `ExpertsMethod`, the experts' counterpart of a LinearMethod:
in the model dtype (`ExpertsMethod` here), or in 8 bits with their scales (quant/experts.py).

Tensor parallelism splits every expert's intermediate dimension across ranks (each rank holds
rows [r * I / N, (r + 1) * I / N) of every gate and up projection and the matching columns of
down), the router is whole on every rank, and the ranks' partial sums are all-reduced once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.model_worker.distributed.parallel import TensorParallel
from services.model_worker.kernels import cpu_moe, triton_moe
from services.model_worker.model.layers.weights import CheckpointTensor, WeightShapeError

# (checkpoint name part, which of w13/w2, which part of it): the published per-expert tensors.
EXPERT_PARTS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
# transformers' fused 3-D tensors, as its Qwen3Moe model holds them in memory.
FUSED_PARTS = {"gate_up_proj": "w13", "down_proj": "w2"}


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) in dtype, expert ids (T, k)): softmax in float32 over all experts, then top k,
    rescaled to sum to one when renormalize, as the reference router does."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class Grouping:
    """A step's (token, choice) pairs sorted by expert: pair i of the sorted order is token
    token_of[i]'s choice, and expert e's pairs are rows offsets[e-1]:offsets[e] (offsets is cumulative).

    Computed with device ops only (no host sync), so a CUDA graph can capture it.
    """

    def __init__(self, ids: torch.Tensor, num_experts: int):
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        self.order = torch.argsort(flat, stable=True)  # (T * k,) pair indices, expert-major
        self.token_of = self.order // top_k
        counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        self.counts = counts
        self.offsets = torch.cumsum(counts, 0, dtype=torch.int32)


class ExpertsKernel:
    """How the grouped SwiGLU experts are computed: sum over k of weight * down(silu(gate(x)) * up(x))."""

    name = "base"

    def __call__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def _grouped_mm():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _grouped_matmul(rows: torch.Tensor, weight: torch.Tensor, grouping: Grouping) -> torch.Tensor:
    """rows (P, K) sorted by expert times each one's expert's weight (E, N, K) transposed: (P, N).

    torch's grouped matmul wants every row 16-byte aligned (true of real models' sizes); other
    shapes gather each pair's expert weight instead (a copy per pair: tiny test shapes only).
    """
    grouped_mm = _grouped_mm()
    aligned = all(n * rows.element_size() % 16 == 0 for n in (rows.shape[1], weight.shape[1]))
    if grouped_mm is not None and aligned:
        return grouped_mm(rows.contiguous(), weight.transpose(1, 2), offs=grouping.offsets)
    experts = torch.repeat_interleave(torch.arange(weight.shape[0], device=rows.device), grouping.counts.long(),
                                      output_size=rows.shape[0])
    return torch.bmm(weight[experts], rows.unsqueeze(-1)).squeeze(-1)


class TorchGroupedExperts(ExpertsKernel):
    """torch's grouped matmul: one call per projection over the pairs sorted by expert.

    The weights are passed transposed as views (no copy); experts no pair chose are empty groups
    and their weights are not read.
    """

    name = "torch-grouped"

    def __call__(self, x, w13, w2, weights, ids):
        grouping = Grouping(ids, w13.shape[0])
        rows = x[grouping.token_of]                                    # (P, H), P = T * k
        gate_up = _grouped_matmul(rows, w13, grouping)                 # (P, 2I)
        gate, up = gate_up.chunk(2, dim=-1)
        down = _grouped_matmul(F.silu(gate) * up, w2, grouping)        # (P, H)
        down = down * weights.reshape(-1)[grouping.order, None]
        return torch.zeros_like(x).index_add_(0, grouping.token_of, down)


class TritonExperts(ExpertsKernel):
    """The Triton grouped matmuls (kernels/triton_moe.py), for weights on a GPU."""

    name = "triton"

    def __call__(self, x, w13, w2, weights, ids):
        return triton_moe.fused_moe(x, w13, w2, weights, ids)


def reference_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    """Token by token, choice by choice, in float64: what every kernel is tested against (never served)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    x64, w13_64, w2_64, weights64 = x.double().cpu(), w13.double().cpu(), w2.double().cpu(), weights.double().cpu()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13_64[e] @ x64[t]).chunk(2)
            out[t] += weights64[t, j] * (w2_64[e] @ (F.silu(gate) * up))
    return out


class CpuExperts(ExpertsKernel):
    """The C kernel (kernels/moe.c) for decode-sized steps; torch's grouped matmul for longer ones.

    The C kernel streams each chosen expert's weights once through vector dot products, which is
    what a decode step needs (a few rows per expert); a prefill of many tokens gives each expert
    enough rows for the blocked matmuls behind torch's grouped_mm to win.
    """

    name = "cpu-c"
    MAX_TOKENS = 32

    def __init__(self, library):
        self.library = library
        self.fallback = TorchGroupedExperts()

    def __call__(self, x, w13, w2, weights, ids):
        if x.shape[0] > self.MAX_TOKENS:
            return self.fallback(x, w13, w2, weights, ids)
        return cpu_moe.moe_experts(self.library, x, w13, w2, weights, ids)


def pick_experts_kernel(w13: torch.Tensor, w2: torch.Tensor) -> ExpertsKernel:
    """The fastest kernel that takes these weights: C on a CPU, Triton on a GPU, torch's grouped matmul else."""
    if w13.device.type == "cpu" and cpu_moe.supports(w13, w2):
        library = cpu_moe.load()
        if library is not None:
            return CpuExperts(library)
    if w13.device.type == "cuda" and triton_moe.available():
        return TritonExperts()
    return TorchGroupedExperts()


class ExpertsMethod:
    """How a FusedMoE holds and multiplies its experts: w13 and w2 in the model dtype, and the kernel
    picked for their device once loaded. quant/experts.py holds them in 8 bits instead."""

    name = "plain"

    def create_weights(self, moe: FusedMoE, hidden_size: int) -> None:
        """The parameters the checkpoint fills (w13 (E, 2I, H), w2 (E, H, I); I this rank's share)."""
        local = moe.intermediate_size
        moe.w13 = nn.Parameter(torch.empty(moe.num_experts, 2 * local, hidden_size), requires_grad=False)
        moe.w2 = nn.Parameter(torch.empty(moe.num_experts, hidden_size, local), requires_grad=False)

    def checkpoint_tensor(self, moe: FusedMoE, leaf: str, source: CheckpointTensor, rows: int) -> CheckpointTensor:
        """The checkpoint tensor that fills `leaf` as the loader reads it (8-bit scales are mapped here)."""
        return source

    def process_weights_after_loading(self, moe: FusedMoE) -> None:
        moe.kernel = pick_experts_kernel(moe.w13, moe.w2)

    def apply(self, moe: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return moe.kernel(x, moe.w13, moe.w2, weights, ids)


class FusedMoE(nn.Module):
    """The experts of one layer: w13 (E, 2 * I / N, H) and w2 (E, H, I / N) on this rank of N.

    method: how they are held (default: in the model dtype); 8-bit methods add w13_scale and w2_scale,
    one row of scales per weight row, as the 8-bit linear layers hold theirs."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 tp: TensorParallel | None = None, method: ExpertsMethod | None = None):
        super().__init__()
        self.tp = tp = tp or TensorParallel()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size // tp.size  # this rank's share of every expert
        self.method = method or ExpertsMethod()
        self.method.create_weights(self, hidden_size)
        self.kernel = TorchGroupedExperts()

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x (T, H), router_logits (T, E) -> (T, H), summed over the ranks."""
        weights, ids = route(router_logits, self.top_k, self.renormalize, x.dtype)
        return self.tp.all_reduce(self.method.apply(self, x, weights, ids))

    def weight_loader(self, leaf: str, source: CheckpointTensor, shard) -> None:
        """shard: (expert, part) for a published per-expert tensor; None for a whole 3-D tensor.

        leaf: w13 or w2, or their 8-bit scales w13_scale and w2_scale (one row of scales per weight row, one
        column per block of inputs): read like the weights, by rows for w13 and by columns for w2."""
        local, rank, size = self.intermediate_size, self.tp.rank, self.tp.size
        rows = slice(rank * local, (rank + 1) * local)
        if shard is not None:
            expert, part = shard
            param = getattr(self, leaf).data
            if leaf.startswith("w13"):
                source = self.method.checkpoint_tensor(self, leaf, source, local * size)
                want = [local * size, param.shape[2]]
                dest, index = param[expert, part * local:(part + 1) * local], (rows, slice(None))
            else:
                source = self.method.checkpoint_tensor(self, leaf, source, param.shape[1])
                columns = param.shape[2]  # this rank's inputs, or its blocks of them (scales)
                want = [param.shape[1], columns * size]
                dest, index = param[expert], (slice(None), slice(rank * columns, (rank + 1) * columns))
            shape = list(source.get_shape())
            if shape != want:
                raise WeightShapeError(f"checkpoint {shape}, config expects {want}")
            dest.copy_(source[index])
            return
        shape = list(source.get_shape())
        full = local * self.tp.size
        if leaf == "w13":
            want = [self.num_experts, 2 * full, self.w13.shape[2]]
            if shape != want:
                raise WeightShapeError(f"checkpoint {shape}, config expects {want}")
            self.w13.data[:, :local].copy_(source[:, rows])
            self.w13.data[:, local:].copy_(source[:, full + rank * local:full + (rank + 1) * local])
        else:
            want = [self.num_experts, self.w2.shape[1], full]
            if shape != want:
                raise WeightShapeError(f"checkpoint {shape}, config expects {want}")
            self.w2.data.copy_(source[:, :, rows])

    def process_weights_after_loading(self) -> None:
        """The weights' final form (8-bit quantizing on load), and the kernel for their device, once."""
        self.method.process_weights_after_loading(self)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, intermediate_size={self.intermediate_size}, "
                f"renormalize={self.renormalize}, method={self.method.name}, kernel={self.kernel.name}")
