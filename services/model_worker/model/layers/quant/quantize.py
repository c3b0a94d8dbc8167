"""Quantizing a weight to 8 bits and back (and int8 into the VNNI kernel's order), and block scales per weight row.

Both formats are held the same way: q (N, K), int8 or float8_e4m3fn, and float32 scales (N, ceil(K / block_k))
such that the weight is q * scale: fp8 has Qwen's 128 x 128 blocks (a checkpoint's (ceil(N / 128), ceil(K / 128))
scales repeated for each row of their block), int8 one scale a row (block_k = K). A scale per row, not
per block of rows, lets a fused layer's parts and a tensor-parallel rank's rows start anywhere.
"""
from __future__ import annotations

import torch

from services.model_worker.config.quantization import FP8_BLOCK
from services.model_worker.distributed.parallel import TensorParallel
from services.model_worker.model.layers.weights import CheckpointTensor

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
INT8_MAX = 127   # symmetric: -127..127, so the scale is amax / 127


def quantize_int8(weight: torch.Tensor, tp: TensorParallel | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row symmetric int8: scale = amax / 127 (1 for an all-zero row), q = round(w / scale),
    half to even, in float32. Returns (q (N, K) int8, scales (N, 1) float32). tp: the ranks that each hold
    part of every row (a row-parallel layer), whose amax is taken over the whole row, as on one rank."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    if tp is not None:
        amax = tp.all_max(amax)
    scales = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scales).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


VNNI_GROUP = 64  # outputs in one group of the VNNI order: four vectors of 16


def pack_int8_vnni(q: torch.Tensor) -> torch.Tensor:
    """int8 (N, K) weights (N a multiple of 16, K of 4) in the order w8a8_linear.c's VNNI kernel streams them:
    groups of 64 outputs (the last one N % 64 wide), each held as (K / 4, width, 4), so that one 64-byte line is
    16 outputs x 4 consecutive inputs; every byte + 128 (dpbusd multiplies unsigned by signed bytes). Flat
    (N * K,) uint8: the group starting at output n0 begins at byte n0 * K."""
    n, k = q.shape
    if n % 16 or k % 4:
        raise ValueError(f"VNNI order needs outputs a multiple of 16 and inputs of 4, not {tuple(q.shape)}")
    unsigned = q.view(torch.uint8) ^ 0x80
    whole = n // VNNI_GROUP * VNNI_GROUP
    groups = unsigned[:whole].view(-1, VNNI_GROUP, k // 4, 4).transpose(1, 2)
    tail = unsigned[whole:].view(-1, k // 4, 4).transpose(0, 1)
    return torch.cat([groups.reshape(-1), tail.reshape(-1)])


def unpack_int8_vnni(packed: torch.Tensor, n: int) -> torch.Tensor:
    """pack_int8_vnni undone: the (N, K) int8 weights."""
    k = packed.numel() // n
    whole = n // VNNI_GROUP * VNNI_GROUP
    groups = packed[:whole * k].view(-1, k // 4, VNNI_GROUP, 4).transpose(1, 2).reshape(whole, k)
    tail = packed[whole * k:].view(k // 4, n - whole, 4).transpose(0, 1).reshape(n - whole, k)
    return (torch.cat([groups, tail]) ^ 0x80).view(torch.int8)


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block float8_e4m3fn, as Qwen's FP8 checkpoints: scale = amax / 448 over each block (1 for an
    all-zero block; the last block of a dimension may be partial), q = float8(w / scale) to nearest even.
    Returns (q (N, K), block scales (ceil(N / bn), ceil(K / bk)) float32), the checkpoint's layout."""
    bn, bk = block
    w = weight.float()
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk)
    padded[:n, :k] = w
    amax = padded.view(nb, bn, kb, bk).abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / expand_blocks(scales, bn, bk, n, k)).to(torch.float8_e4m3fn)
    return q, scales


def expand_blocks(scales: torch.Tensor, bn: int, bk: int, n: int, k: int) -> torch.Tensor:
    """(NB, KB) block scales to one scale per element, (n, k)."""
    return scales.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def dequantize(q: torch.Tensor, scales: torch.Tensor, block_k: int, dtype: torch.dtype) -> torch.Tensor:
    """q * scale in float32 (the value a float32 dequantization of the checkpoint holds), as dtype."""
    k = q.shape[1]
    per_element = scales if block_k == k else scales.repeat_interleave(block_k, 1)[:, :k]
    return (q.float() * per_element).to(dtype)


class RowScales:
    """A checkpoint's (ceil(N / block_rows), KB) block scales seen as (rows, KB): one row of scales per weight
    row. Read through a slice, like a safetensors tensor, so a layer reads its rows of it as of its weight."""

    def __init__(self, source: CheckpointTensor, block_rows: int, rows: int):
        self.source, self.block_rows, self.rows = source, block_rows, rows

    def get_shape(self) -> list[int]:
        blocks, columns = self.source.get_shape()
        if -(-self.rows // self.block_rows) != blocks:
            # Not this weight's scales: report the shape as stored, so the shape check names it.
            return [blocks, columns]
        return [self.rows, columns]

    def __getitem__(self, index) -> torch.Tensor:
        rows, columns = index if isinstance(index, tuple) else (index, slice(None))
        start, stop, _ = rows.indices(self.rows)
        first = start // self.block_rows
        last = -(-stop // self.block_rows)
        blocks = self.source[first:last, columns].float()
        offset = first * self.block_rows
        return blocks.repeat_interleave(self.block_rows, 0)[start - offset:stop - offset]
