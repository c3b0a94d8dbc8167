"""The 8-bit-weight matmul C kernels, called through ctypes: q8_linear.c (int8 or fp8 e4m3 weights with
float32 scales per (row, block of inputs), bf16 activations and outputs) and w8a8_linear.c (int8 weights
with a scale per row, the bf16 activations quantized to int8 per row in the call)."""
from __future__ import annotations

import ctypes
import pathlib

import torch

from services.model_worker.kernels import build

SOURCE = pathlib.Path(__file__).with_name("q8_linear.c")
W8A8_SOURCE = pathlib.Path(__file__).with_name("w8a8_linear.c")
_ARGS = [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]


class Q8Kernels:
    """The loaded libraries: q8_linear.c's gemv (few rows, AVX-512), amx (more rows; False without AMX) and
    dequantize; w8a8: w8a8_linear.c (None where it does not build), with w8a8_amx (AMX-INT8) and w8a8_vnni
    (AVX512-VNNI) saying which of its kernels this CPU runs."""

    def __init__(self, library: ctypes.CDLL, amx: bool, w8a8: ctypes.CDLL | None = None):
        self.library = library
        self.amx = amx
        self.w8a8 = w8a8
        self.w8a8_amx = w8a8 is not None and bool(w8a8.w8a8_amx_supported())
        self.w8a8_vnni = w8a8 is not None and bool(w8a8.w8a8_vnni_supported())


def load() -> Q8Kernels | None:
    """The compiled kernels; None where they cannot be built or the CPU has no AVX-512."""
    library = build.load(SOURCE, "8-bit linear")
    if library is None or not library.q8_linear_supported():
        return None
    for name in ("q8_linear", "q8_linear_amx"):
        getattr(library, name).argtypes = _ARGS
        getattr(library, name).restype = ctypes.c_int
    library.q8_dequantize.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    library.q8_dequantize.restype = ctypes.c_int
    w8a8 = build.load(W8A8_SOURCE, "int8 x int8 linear")
    if w8a8 is not None:
        for name in ("w8a8_linear", "w8a8_linear_amx"):
            getattr(w8a8, name).argtypes = _ARGS
            getattr(w8a8, name).restype = ctypes.c_int
    return Q8Kernels(library, bool(library.q8_amx_supported()), w8a8)


def supports(weight: torch.Tensor, block_k: int) -> bool:
    return (weight.device.type == "cpu" and weight.element_size() == 1 and weight.is_contiguous()
            and weight.shape[1] % 32 == 0 and block_k % 16 == 0)


def _is_fp8(weight: torch.Tensor) -> int:
    return int(weight.dtype == torch.float8_e4m3fn)


def linear(kernels: Q8Kernels, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block_k: int,
           amx: bool) -> torch.Tensor:
    """x: (..., K) bf16; weight: (N, K) int8 or float8_e4m3fn; scales: (N, ceil(K / block_k)) float32.
    Returns x @ (weight * scales).T, (..., N) bf16; amx: on AMX tiles (N a multiple of 32)."""
    kernel = kernels.library.q8_linear_amx if amx else kernels.library.q8_linear
    return _call(kernel, x, weight, scales, block_k)


def w8a8_linear(kernels: Q8Kernels, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                amx: bool) -> torch.Tensor:
    """x: (..., K) bf16; scales: (N, 1) float32. x's rows quantized to int8 (scale max|row| / 127, rounded half
    to even) times the int8 weight, in int32, then scaled: (..., N) bf16. amx: on AMX-INT8 tiles, weight (N, K)
    int8 with N a multiple of 32; else AVX512-VNNI, weight packed by quantize.pack_int8_vnni (N a multiple of 16)."""
    if amx:
        return _call(kernels.w8a8.w8a8_linear_amx, x, weight, scales, weight.shape[1])
    n = scales.shape[0]
    return _call(kernels.w8a8.w8a8_linear, x, weight, scales, weight.numel() // n, n=n)


def _call(kernel, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, block_k: int,
          n: int | None = None) -> torch.Tensor:
    """n: the outputs, where the weight is not held as (N, K)."""
    n = weight.shape[0] if n is None else n
    k = weight.numel() // n
    flat = x.dim() == 2 and x.is_contiguous()
    rows = x if flat else x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    status = kernel(rows.data_ptr(), weight.data_ptr(), scales.data_ptr(), out.data_ptr(), rows.shape[0], n, k,
                    block_k, _is_fp8(weight))
    if status != 0:
        raise RuntimeError(f"{kernel.__name__} failed with status {status} for {tuple(rows.shape)} x "
                           f"{tuple(weight.shape)}")
    return out if flat else out.view(*x.shape[:-1], n)


def dequantize(kernels: Q8Kernels, weight: torch.Tensor, scales: torch.Tensor, block_k: int) -> torch.Tensor:
    """The weight as bf16(q * scale), (N, K): for prompts long enough that oneDNN's GEMM wins."""
    out = torch.empty(weight.shape, dtype=torch.bfloat16)
    status = kernels.library.q8_dequantize(weight.data_ptr(), scales.data_ptr(), out.data_ptr(), weight.shape[0],
                                           weight.shape[1], block_k, _is_fp8(weight))
    if status != 0:
        raise RuntimeError(f"q8_dequantize failed with status {status} for {tuple(weight.shape)}")
    return out
