"""Attention over a paged KV cache for a flat batch of tokens from several sequences.

The runner describes a step once, as a few tensors (AttentionMetadata), and every layer's
attention reads them: no per-sequence Python inside the forward, and a fixed number of kernel
calls per layer whatever the batch size. A backend (chosen once, by the runner, for the device
and dtype) does the arithmetic; each one is checked against a float64 reference in the tests.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.model_worker.kernels import cpu_attention, triton_attention
from services.model_worker.step_inputs import StepInputs


@dataclass
class PrefillLayout:
    """The sequences with more than one new token, padded to (P, Lq) queries against (P, Lk) keys.

    One SDPA call computes them all. Padding rows and keys are masked; padding query rows attend
    to key 0 only, so they stay finite and are dropped from the output.
    """

    query_rows: torch.Tensor        # (P, Lq) row of q for each padded query (padding repeats a real row)
    key_slots: torch.Tensor | None  # (P * Lk,) cache slot of each padded key; None: keys are this step's own
    mask: torch.Tensor | None       # (P, 1, Lq, Lk) True where a query may attend; None: plain causal
    out_rows: torch.Tensor          # (Tp,) padded query index (p * Lq + i) of each real prefill row, in batch order
    rows: torch.Tensor              # (Tp,) their rows in the flat batch
    # One sequence: the first of its rows, which run on unpadded through the batch. Its queries,
    # keys and output are then views, not gathered copies (5% of a 128-token prefill's time).
    single_start: int | None = None

    @classmethod
    def build(cls, query_start: torch.Tensor, q_lens: torch.Tensor, context: torch.Tensor, table: torch.Tensor,
              block_size: int) -> "PrefillLayout | None":
        seqs = torch.nonzero(q_lens > 1).flatten()
        if seqs.numel() == 0:
            return None
        q_lens, context, starts = q_lens[seqs], context[seqs], query_start[seqs]
        max_q, max_k = int(q_lens.max()), int(context.max())
        i = torch.arange(max_q)
        valid = i[None, :] < q_lens[:, None]                                   # (P, Lq)
        query_rows = starts[:, None] + torch.minimum(i[None, :], q_lens[:, None] - 1)
        out_rows = torch.nonzero(valid.flatten()).flatten()
        rows = query_rows.flatten()[out_rows]
        fresh = bool((context == q_lens).all())  # nothing cached: the keys are this step's own tokens
        single_start = int(starts[0]) if seqs.numel() == 1 else None
        if fresh and seqs.numel() == 1:
            return cls(query_rows, None, None, out_rows, rows, single_start)
        j = torch.arange(max_k)
        query_pos = (context - q_lens)[:, None] + i[None, :]                   # (P, Lq)
        mask = (j[None, None, :] <= query_pos[:, :, None]) & valid[:, :, None]
        mask[:, :, 0] = True  # padding queries see key 0: finite, and discarded
        key_slots = None if fresh else _slots(table[seqs], max_k, block_size).flatten()
        return cls(query_rows, key_slots, mask[:, None], out_rows, rows, single_start)

    def to(self, device: torch.device) -> "PrefillLayout":
        return PrefillLayout(*(None if t is None else t.to(device, non_blocking=True) for t in (
            self.query_rows, self.key_slots, self.mask, self.out_rows, self.rows)), self.single_start)


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each one may attend to.

    The flat batch holds T tokens from B sequences, sequence b's tokens contiguous. Built once
    per step by the runner, on the CPU, and moved to the device in one go; every layer shares it.
    The first four fields are the layout varlen and paged kernels take.
    """

    slot_mapping: torch.Tensor     # (T,) int64: cache slot written by each new token
    query_start_loc: torch.Tensor  # (B + 1,) int32: cu_seqlens of the queries
    context_lens: torch.Tensor     # (B,) int32: tokens in each sequence's context after this step
    block_tables: torch.Tensor     # (B, max_blocks) int32, padded with block 0
    block_size: int
    max_query_len: int
    max_context_len: int
    backend: "AttentionBackend"
    # Mixed steps only (max_query_len > 1): the one-token sequences, and the layout of the others.
    decode_seqs: torch.Tensor | None = None      # (Bd,) their batch indices
    decode_rows: torch.Tensor | None = None      # (Bd,) their rows in the flat batch
    prefill: PrefillLayout | None = None

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
              block_size: int, device: torch.device, backend: "AttentionBackend | None" = None
              ) -> "AttentionMetadata":
        """context_lens count each sequence's tokens after this step (cached + new)."""
        host = StepInputs.build([[0] * n for n in query_lens], block_tables, context_lens, block_size)
        return cls.from_inputs(host.to(device), host, block_size, backend or default_backend(device))

    @classmethod
    def from_inputs(cls, inputs: StepInputs, host: StepInputs, block_size: int, backend: "AttentionBackend"
                    ) -> "AttentionMetadata":
        """inputs: the step's tensors on the device; host: the same on the CPU, for the mixed-step layout."""
        mixed = {}
        if host.max_query_len > 1 and not backend.whole_step:
            device = inputs.slot_mapping.device
            q_lens = host.query_start_loc.diff()
            decode_seqs = torch.nonzero(q_lens == 1).flatten()
            prefill = PrefillLayout.build(host.query_start_loc, q_lens, host.context_lens, host.block_tables,
                                          block_size)
            mixed = dict(decode_seqs=decode_seqs.to(device),
                         decode_rows=host.query_start_loc[decode_seqs].long().to(device), prefill=prefill.to(device))
        return cls(inputs.slot_mapping, inputs.query_start_loc, inputs.context_lens, inputs.block_tables, block_size,
                   host.max_query_len, host.max_context_len, backend, **mixed)


class AttentionBackend:
    """Computes attention for one layer of a step, given q and this step's k, v (already in the cache)."""

    name = "base"
    whole_step = False  # True: attend() takes decodes and prefills together, no layout needed

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: "AttentionMetadata",
               scale: float) -> torch.Tensor:
        """q: (T, H, D) for the whole step, its keys already in the cache. Returns (T, H, D)."""
        raise NotImplementedError

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context_lens: torch.Tensor,
               block_tables: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
        """q: (N, H, D), one query per sequence at its last position. Returns (N, H, D)."""
        raise NotImplementedError

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """This step's keys and values, (T, Hkv, D), into their cache slots."""
        k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1))


class TorchAttention(AttentionBackend):
    """Plain PyTorch for every device: decodes are padded prefills of one query (SDPA over gathered keys)."""

    name = "torch"

    def decode(self, q, k_cache, v_cache, context_lens, block_tables, block_size, scale):
        n, max_k = context_lens.shape[0], int(context_lens.max())
        slots = _slots(block_tables, max_k, block_size).flatten()
        j = torch.arange(max_k, device=q.device)
        mask = (j[None, :] < context_lens[:, None])[:, None, None, :]        # (N, 1, 1, Lk)
        keys = _gather(k_cache, slots, n)
        values = _gather(v_cache, slots, n)
        num_kv_heads = k_cache.shape[0]
        queries = q.reshape(n, num_kv_heads, q.shape[1] // num_kv_heads, q.shape[2])
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        return out.reshape(n, q.shape[1], q.shape[2])


class CpuPagedAttention(TorchAttention):
    """Decodes through the C kernel, which reads keys in place through the block tables."""

    name = "cpu-paged"

    def __init__(self, library):
        self.library = library

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        # One C call for four torch ops: at 16 sequences index_copy_ alone took about 3 ms a step.
        if cpu_attention.can_write_kv(k, v, k_cache, v_cache, slot_mapping):
            cpu_attention.write_kv(self.library, k, v, k_cache, v_cache, slot_mapping)
        else:
            super().write_kv(k, v, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, context_lens, block_tables, block_size, scale):
        if not cpu_attention.supports(q.dtype):
            return super().decode(q, k_cache, v_cache, context_lens, block_tables, block_size, scale)
        return cpu_attention.paged_decode_attention(self.library, q, k_cache, v_cache, context_lens, block_tables,
                                                    block_size, scale)


class TritonPagedAttention(AttentionBackend):
    """The whole step, decodes and prefills, in one Triton kernel per layer (the GPU backend)."""

    name = "triton"
    whole_step = True

    def attend(self, q, k_cache, v_cache, meta, scale):
        return triton_attention.paged_attention(q, k_cache, v_cache, meta.query_start_loc, meta.context_lens,
                                                meta.block_tables, meta.block_size, meta.max_query_len, scale)


def _slots(block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """(N, length) cache slots of positions 0..length-1 of each sequence (past a table's end: its last block)."""
    j = torch.arange(length, device=block_tables.device)
    blocks = torch.clamp(j // block_size, max=block_tables.shape[1] - 1)
    return block_tables.long()[:, blocks] * block_size + j % block_size


def _gather(cache: torch.Tensor, slots: torch.Tensor, batch: int) -> torch.Tensor:
    """(Hkv, slots, D) cache rows at the given slots, as (batch, Hkv, slots / batch, D)."""
    rows = cache.index_select(1, slots)
    return rows.view(cache.shape[0], batch, -1, cache.shape[2]).transpose(0, 1)


@functools.lru_cache(maxsize=None)
def default_backend(device: torch.device) -> AttentionBackend:
    """The fastest backend that runs here: Triton on CUDA, the C kernel on CPU (float32, bfloat16), else PyTorch."""
    if device.type == "cuda" and triton_attention.available():
        return TritonPagedAttention()
    if device.type == "cpu":
        library = cpu_attention.load()
        if library is not None:
            return CpuPagedAttention(library)
    return TorchAttention()


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, H, D); k, v: (T, Hkv, D); caches: (Hkv, slots, D). Writes k, v to the cache; returns (T, H, D)."""
    meta.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.backend.whole_step:
        return meta.backend.attend(q, k_cache, v_cache, meta, scale)
    if meta.max_query_len == 1:  # a pure decode step, the common case
        return meta.backend.decode(q, k_cache, v_cache, meta.context_lens, meta.block_tables, meta.block_size, scale)
    layout = meta.prefill
    if layout.single_start == 0 and layout.query_rows.shape[1] == q.shape[0]:  # the step is one prefill
        return _prefill(q, k, v, k_cache, v_cache, layout, scale)
    out = torch.empty_like(q)
    if meta.decode_seqs.numel():
        out[meta.decode_rows] = meta.backend.decode(q[meta.decode_rows], k_cache, v_cache,
                                                    meta.context_lens[meta.decode_seqs],
                                                    meta.block_tables[meta.decode_seqs], meta.block_size, scale)
    out[meta.prefill.rows] = _prefill(q, k, v, k_cache, v_cache, meta.prefill, scale)
    return out


def _prefill(q, k, v, k_cache, v_cache, layout: PrefillLayout, scale: float) -> torch.Tensor:
    """The prefill rows' attention, in batch order: one SDPA call over the padded layout."""
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    batch, max_q = layout.query_rows.shape

    def pick(t: torch.Tensor) -> torch.Tensor:
        """t's prefill rows as (P, Lq, ...): a view for one sequence, else a padded copy."""
        if layout.single_start is not None:
            return t[layout.single_start:layout.single_start + max_q].unsqueeze(0)
        return t[layout.query_rows]

    queries = pick(q).transpose(1, 2)                                          # (P, H, Lq, D)
    if layout.key_slots is None:
        keys, values = pick(k).transpose(1, 2), pick(v).transpose(1, 2)        # (P, Hkv, Lq, D)
    else:
        keys = _gather(k_cache, layout.key_slots, batch)
        values = _gather(v_cache, layout.key_slots, batch)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=layout.mask,
                                         is_causal=layout.mask is None, scale=scale,
                                         enable_gqa=num_kv_heads != num_heads)  # (P, H, Lq, D)
    out = out.transpose(1, 2).reshape(batch * max_q, num_heads, head_dim)
    return out if layout.single_start is not None else out[layout.out_rows]
