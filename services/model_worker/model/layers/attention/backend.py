"""The interface every attention backend implements, and the cache gather they share."""
from __future__ import annotations

import torch

from services.model_worker.model.layers.attention import kv_quant
from services.model_worker.model.layers.attention.layout import PrefillLayout


class AttentionBackend:
    """Computes attention for one layer of a step, given q and this step's k, v (already in the cache)."""

    name = "base"
    whole_step = False  # True: attend() takes decodes and prefills together, no layout needed

    # Every method takes k_scale and v_scale as keywords where the cache is 8-bit (kv_quant.py), and is called
    # without them otherwise.

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
               context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, max_query_len: int,
               scale: float) -> torch.Tensor:
        """q: (T, H, D) for the whole step, its keys already in the cache. Returns (T, H, D).

        Takes the step's tensors rather than its AttentionMetadata, which holds a backend: naming it
        here would make the two modules import each other.
        """
        raise NotImplementedError

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context_lens: torch.Tensor,
               block_tables: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
        """q: (N, H, D), one query per sequence at its last position. Returns (N, H, D)."""
        raise NotImplementedError

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, layout: PrefillLayout, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """The prefill rows' attention, each sequence over its own rows (see PrefillLayout).

        out: (T, H, D) to write each sequence's rows into; None: the step is one sequence alone
        and its result is returned as (Lq, H, D).
        """
        raise NotImplementedError

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
        """This step's keys and values, (T, Hkv, D), into their cache slots (quantized into an 8-bit cache)."""
        if k_scale is not None:
            kv_quant.write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
            return
        k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1))
        v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1))


def gather_cache(cache: torch.Tensor, slots: torch.Tensor, batch: int, scale: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """(Hkv, slots, D) cache rows at the given slots, as (batch, Hkv, slots / batch, D); an 8-bit cache's
    dequantized to dtype with its scale."""
    rows = kv_quant.gather_rows(cache, scale, slots, dtype or cache.dtype)
    return rows.view(cache.shape[0], batch, -1, cache.shape[2]).transpose(0, 1)
