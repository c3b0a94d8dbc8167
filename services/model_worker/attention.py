"""Attention over a paged KV cache for a flat batch of tokens from several sequences."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each one may attend to.

    Built once per step by the runner and shared by every layer. The flat batch
    holds T tokens from B sequences, sequence b's tokens contiguous.
    """

    slot_mapping: torch.Tensor  # (T,) flat cache slot written by each new token
    kv_slots: torch.Tensor      # (B, Lk) flat cache slots of each sequence's context, padded
    query_index: torch.Tensor | None  # (B, Lq) flat token of each padded query row; None if every q_len is 1
    output_index: torch.Tensor | None  # (T,) row of each token in the padded (B * Lq) output
    mask: torch.Tensor | None   # (B, 1, Lq, Lk) True where a query may attend a key; None = attend all

    @classmethod
    def build(cls, block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
              block_size: int, device: torch.device) -> "AttentionMetadata":
        """context_lens count each sequence's tokens after this step (cached + new)."""
        batch = len(block_tables)
        max_kv = max(context_lens)
        max_q = max(query_lens)
        kv_slots = torch.zeros(batch, max_kv, dtype=torch.long)
        slot_mapping = []
        for b, (table, kv_len, q_len) in enumerate(zip(block_tables, context_lens, query_lens)):
            positions = torch.arange(kv_len)
            slots = torch.tensor(table, dtype=torch.long)[positions // block_size] * block_size \
                + positions % block_size
            kv_slots[b, :kv_len] = slots
            slot_mapping.append(slots[kv_len - q_len:])
        slot_mapping_t = torch.cat(slot_mapping)

        kv_lens = torch.tensor(context_lens)
        q_lens = torch.tensor(query_lens)
        key_pos = torch.arange(max_kv)
        if max_q == 1:
            query_index = output_index = None
            # A single query per sequence sees its whole context; only padding is masked.
            mask = (key_pos[None, :] < kv_lens[:, None])[:, None, None, :]
            if bool(mask.all()):
                mask = None
        else:
            starts = torch.cumsum(q_lens, 0) - q_lens
            rows = torch.arange(max_q)
            valid_q = rows[None, :] < q_lens[:, None]                      # (B, Lq)
            query_index = torch.where(valid_q, starts[:, None] + rows[None, :], 0)
            output_index = (torch.arange(batch)[:, None] * max_q + rows[None, :])[valid_q]
            query_pos = kv_lens[:, None] - q_lens[:, None] + rows[None, :]  # (B, Lq) position in its sequence
            mask = key_pos[None, None, :] <= query_pos[:, :, None]         # causal, also hides padding keys
            # Padding query rows would have nothing to attend (NaN); let them see key 0 and drop them later.
            mask |= (~valid_q)[:, :, None] & (key_pos == 0)[None, None, :]
            mask = mask[:, None]
        to = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return cls(to(slot_mapping_t), to(kv_slots), to(query_index), to(output_index), to(mask))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, H, D); k, v: (T, Hkv, D); caches: (num_blocks, block_size, Hkv, D). Returns (T, H, D)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)

    keys = k_flat[meta.kv_slots].transpose(1, 2)    # (B, Hkv, Lk, D)
    values = v_flat[meta.kv_slots].transpose(1, 2)
    if meta.query_index is None:
        queries = q[:, None].transpose(1, 2)       # (B, H, 1, D)
    else:
        queries = q[meta.query_index].transpose(1, 2)  # (B, H, Lq, D)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.mask, scale=scale,
                                         enable_gqa=keys.shape[1] != num_heads)
    out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # (B * Lq, H, D)
    return out if meta.output_index is None else out[meta.output_index]
