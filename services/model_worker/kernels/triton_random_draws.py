"""The sampler's counter-based draws on a GPU in one Triton kernel: the same uniforms as
executor/random_draws.py's torch path, bit for bit, in one pass instead of its ~25 over int64
temporaries (about 16 GB of traffic for 256 rows of 151,936 tokens, some 4 ms on an H200).

Row r's words are (s0, s1, w); its keys k_i = lowbias32(s_i ^ w); token t's value
h = lowbias32(lowbias32(t ^ k0) ^ k1) and the uniform ((h >> 8) | 1) / 2**24, in uint32 arithmetic,
which wraps. Its exponential variates come from Triton's log (the torch path's may differ in the last bit).

On a machine without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1), where the tests
check it against the torch path.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch ships without Triton
    triton = None

BLOCK = 1024  # tokens per program


def available() -> bool:
    return triton is not None


if triton is not None:
    @triton.jit
    def _lowbias32(x):
        x ^= x >> 16
        x *= 0x7FEB352D
        x ^= x >> 15
        x *= 0x846CA68B
        x ^= x >> 16
        return x

    @triton.jit
    def _draw_kernel(words_ptr, ids_ptr, ids_row_stride, out_ptr, width, EXPONENTIAL: tl.constexpr,
                     BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < width
        w = tl.load(words_ptr + row * 3 + 2).to(tl.uint32)
        k0 = _lowbias32(tl.load(words_ptr + row * 3).to(tl.uint32) ^ w)
        k1 = _lowbias32(tl.load(words_ptr + row * 3 + 1).to(tl.uint32) ^ w)
        t = tl.load(ids_ptr + row * ids_row_stride + cols, mask=inside, other=0).to(tl.uint32)
        h = _lowbias32(_lowbias32(t ^ k0) ^ k1)
        u = ((h >> 8) | 1).to(tl.float32) * 5.9604644775390625e-08  # 2**-24
        if EXPONENTIAL:
            u = -tl.log(u)
        tl.store(out_ptr + row * width + cols, u, mask=inside)


def draw(words: torch.Tensor, ids: torch.Tensor, exponential: bool) -> torch.Tensor:
    """(R, W) float32 uniforms, or their exponential variates, for (R, 3) int64 words and (1 or R, W) int64 ids."""
    words = words.contiguous()
    if ids.stride(-1) != 1:
        ids = ids.contiguous()
    rows, width = words.shape[0], ids.shape[1]
    out = torch.empty(rows, width, device=words.device)
    if rows and width:
        _draw_kernel[(rows, triton.cdiv(width, BLOCK))](words, ids, ids.stride(0) if ids.shape[0] > 1 else 0, out,
                                                          width, EXPONENTIAL=exponential, BLOCK=BLOCK)
    return out
