"""The 8-bit KV cache formats in torch: their storage dtypes, the quantize and dequantize arithmetic, and a
layer's cache with its scales (docs/kv-cache.md).

fp8: e4m3 with one float32 scale per layer and tensor, (1,): q = fp8(clamp(x / scale, -448, 448)).
int8: one float32 scale per KV head and slot, (Hkv, slots): s = max|x| / 127, q = round(x / s) (ties to
even; a row of zeros has s = 0 and q = 0). Both dequantize as float32(q) * scale. The C and Triton
kernels do the same arithmetic in float32; this module is their reference and the torch backend's path.
"""
from __future__ import annotations

import torch

KV_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
FP8_MAX = 448.0


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for --kv-cache-dtype ("auto": the model's)."""
    return KV_DTYPES.get(kv_cache_dtype, model_dtype)


def is_8bit(cache: torch.Tensor) -> bool:
    return cache.dtype in (torch.float8_e4m3fn, torch.int8)


class LayerCache(tuple):
    """One layer's (k_cache, v_cache), which it unpacks as; an 8-bit cache carries its k_scale and v_scale
    (fp8: (1,) float32 each; int8: (Hkv, slots) float32), None otherwise."""

    def __new__(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
                v_scale: torch.Tensor | None = None):
        self = super().__new__(cls, (k_cache, v_cache))
        self.k_scale, self.v_scale = k_scale, v_scale
        return self

    @property
    def scales(self) -> dict:
        """k_scale and v_scale as keyword arguments where the cache has them, else none."""
        return {} if self.k_scale is None else {"k_scale": self.k_scale, "v_scale": self.v_scale}


def scales_of(cache) -> dict:
    """A layer cache's scales as keyword arguments (a plain (k, v) pair has none)."""
    return cache.scales if isinstance(cache, LayerCache) else {}


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: (..., D) rows in the model's dtype. Returns (q in cache_dtype, the int8 rows' scales (...) float32, or
    None for fp8, whose scale is the given per-layer one)."""
    x = x.float()
    if cache_dtype == torch.float8_e4m3fn:
        return torch.clamp(x / scale.float(), -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), None
    s = x.abs().amax(dim=-1) / 127.0
    # Division, not a multiply by 1 / s: the kernels divide too. A zero row divides by 1 and stays 0.
    q = torch.round(x / torch.where(s == 0, torch.ones_like(s), s).unsqueeze(-1))
    return q.to(torch.int8), s


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32(q) * scale in dtype. q: (Hkv, n, D) cache rows; scale: (1,) fp8's, or (Hkv, n) int8's per row."""
    if scale.dim() == 2:
        scale = scale.unsqueeze(-1)
    return (q.float() * scale).to(dtype)


def as_stored(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """x: (T, Hkv, D) as an 8-bit cache gives it back: quantized and dequantized, in x's dtype."""
    q, row_scales = quantize(x, cache_dtype, scale)
    return (q.float() * (scale.float() if row_scales is None else row_scales.unsqueeze(-1))).to(x.dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """This step's keys and values, (T, Hkv, D), quantized into their 8-bit cache slots (int8: their scales too)."""
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        q, row_scales = quantize(x, cache.dtype, scale)
        _bytes(cache).index_copy_(1, slot_mapping, _bytes(q).transpose(0, 1))
        if row_scales is not None:
            scale.index_copy_(1, slot_mapping, row_scales.transpose(0, 1))


def gather_rows(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, dtype: torch.dtype
                ) -> torch.Tensor:
    """(Hkv, n, D) cache rows at slots in dtype: as stored, or dequantized from an 8-bit cache."""
    if not is_8bit(cache):
        return cache.index_select(1, slots)
    rows = _bytes(cache).index_select(1, slots).view(cache.dtype)
    return dequantize(rows, scale if scale.dim() == 1 else scale.index_select(1, slots), dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as uint8: torch's CPU index_copy_ and index_select have no float8 kernels."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
