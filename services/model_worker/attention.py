"""Attention over a paged KV cache for a flat batch of tokens from several sequences."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SequencePlan:
    """How one sequence of the flat batch attends."""

    query_start: int  # its first token's row in the flat batch
    query_len: int
    # Where its keys are read from: None = only this step's new tokens (a prompt's first chunk),
    # a slice = one stretch of the pool (no copy), a tensor = its slots gathered in order.
    keys: slice | torch.Tensor | None
    mask: torch.Tensor | None  # (Lq, Lk) True where a query may attend a key; None = attend all


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each one may attend to.

    Built once per step by the runner and shared by every layer. The flat batch
    holds T tokens from B sequences, sequence b's tokens contiguous.
    """

    slot_mapping: torch.Tensor  # (T,) flat cache slot written by each new token
    plans: list[SequencePlan]   # (B,) in batch order

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
              block_size: int, device: torch.device) -> "AttentionMetadata":
        """context_lens count each sequence's tokens after this step (cached + new)."""
        slots: list[int] = []
        plans = []
        for table, kv_len, q_len in zip(block_tables, context_lens, query_lens):
            start = kv_len - q_len
            plans.append(_plan(table, kv_len, q_len, len(slots), block_size, device))
            if q_len == 1:  # a decode step: skip building a range
                slots.append(table[start // block_size] * block_size + start % block_size)
            else:
                slots.extend(_slots(table, start, kv_len, block_size).tolist())
        return cls(torch.tensor(slots, device=device), plans)


def _slots(table: list[int], start: int, stop: int, block_size: int) -> torch.Tensor:
    """The cache slots of positions start..stop-1 of a sequence with this block table."""
    positions = torch.arange(start, stop)
    return torch.tensor(table)[positions // block_size] * block_size + positions % block_size


def _plan(table: list[int], kv_len: int, q_len: int, query_start: int, block_size: int,
          device: torch.device) -> SequencePlan:
    if kv_len == q_len:
        # Nothing cached before this step: attend over the new keys themselves, causally.
        return SequencePlan(query_start, q_len, None, None)
    if q_len == 1:
        # A single query attends its whole context, so key order does not matter, only the set:
        # blocks forming one run of ids (in any order) are read in place. A prompt chunk of one
        # token may hold blocks past its context; they are not part of it.
        table = table[:-(-kv_len // block_size)]
        low, high = min(table), max(table)
        if high - low + 1 == len(table):
            fill = kv_len - (len(table) - 1) * block_size  # tokens in the last block
            last = table[-1]
            if last == high:  # every block before the stretch's end is full
                return SequencePlan(query_start, 1, slice(low * block_size, high * block_size + fill), None)
            mask = torch.ones(1, len(table) * block_size, dtype=torch.bool)
            mask[0, (last - low) * block_size + fill:(last - low + 1) * block_size] = False
            return SequencePlan(query_start, 1, slice(low * block_size, (high + 1) * block_size),
                                mask.to(device))
        return SequencePlan(query_start, 1, _slots(table, 0, kv_len, block_size).to(device), None)
    # A later chunk of a prompt (or a prefix-cache hit): its context in order, causal mask.
    query_pos = torch.arange(kv_len - q_len, kv_len)
    mask = torch.arange(kv_len)[None, :] <= query_pos[:, None]
    return SequencePlan(query_start, q_len, _slots(table, 0, kv_len, block_size).to(device), mask.to(device))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, H, D); k, v: (T, Hkv, D); caches: (Hkv, slots, D). Returns (T, H, D)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

    outs = []
    for plan in meta.plans:
        rows = slice(plan.query_start, plan.query_start + plan.query_len)
        if plan.keys is None:
            queries = q[rows].transpose(0, 1)[None]                   # (1, H, Lq, D)
            out = F.scaled_dot_product_attention(
                queries, k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None],
                is_causal=plan.query_len > 1, scale=scale, enable_gqa=num_kv_heads != num_heads)
            outs.append(out[0].transpose(0, 1))
            continue
        keys = k_cache[:, plan.keys][None]                            # (1, Hkv, Lk, D)
        values = v_cache[:, plan.keys][None]
        if plan.query_len == 1:
            # The query heads sharing a KV head become that head's query rows: one kernel call
            # per KV head, which runs far faster than the grouped-query path for one token.
            queries = q[rows].view(1, num_kv_heads, num_heads // num_kv_heads, head_dim)
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan.mask, scale=scale)
            outs.append(out.view(1, num_heads, head_dim))
            continue
        out = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None], keys, values, attn_mask=plan.mask,
                                             scale=scale, enable_gqa=num_kv_heads != num_heads)
        outs.append(out[0].transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
