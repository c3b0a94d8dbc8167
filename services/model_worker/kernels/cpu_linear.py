"""The bf16 matmul C kernels, called through ctypes: on the plain weight, a few rows
(small_batch_linear.c, AVX512-BF16) and up to a few hundred (amx_linear.c, AMX tiles); on a weight
reordered into AMX's VNNI layout, every row count (vnni_linear.c: AMX tiles, or AVX512-BF16 register
tiles on CPUs without AMX)."""
from __future__ import annotations

import ctypes
import pathlib

import torch

from services.model_worker.kernels import build

SOURCE = pathlib.Path(__file__).with_name("small_batch_linear.c")
AMX_SOURCE = pathlib.Path(__file__).with_name("amx_linear.c")
VNNI_SOURCE = pathlib.Path(__file__).with_name("vnni_linear.c")


def load(source: pathlib.Path = SOURCE) -> ctypes.CDLL | None:
    """The compiled kernel; None where it cannot be built or the CPU has no AVX512-BF16. source: another copy
    of small_batch_linear.c (a benchmark's older one)."""
    library = build.load(source, "small-batch linear")
    if library is None or not library.small_batch_linear_supported():
        return None
    library.small_batch_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    library.small_batch_linear.restype = ctypes.c_int
    if hasattr(library, "small_batch_linear_max_rows"):  # an older copy may not have it
        library.small_batch_linear_max_rows.argtypes = [ctypes.c_int64]
        library.small_batch_linear_max_rows.restype = ctypes.c_int
    return library


def small_batch_max_rows(library: ctypes.CDLL, in_features: int) -> int:
    """The most rows of in_features inputs for which the small-batch kernel beats oneDNN on this CPU."""
    if not hasattr(library, "small_batch_linear_max_rows"):
        return 4
    return library.small_batch_linear_max_rows(in_features)


def load_amx() -> ctypes.CDLL | None:
    """The AMX kernel; None where it cannot be built, the CPU has no AMX-BF16 or the OS refuses its tile state."""
    library = build.load(AMX_SOURCE, "AMX linear")
    if library is None or not library.amx_linear_supported():
        return None
    library.amx_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    library.amx_linear.restype = ctypes.c_int
    return library


def load_vnni(source: pathlib.Path = VNNI_SOURCE) -> ctypes.CDLL | None:
    """The kernels on VNNI-ordered weights; None where they cannot be built, the CPU has no AVX512-BF16, or
    it has AMX-BF16 and the OS refuses its tile state. source: another copy of vnni_linear.c (a benchmark's
    older one)."""
    library = build.load(source, "VNNI linear")
    if library is None or not library.vnni_linear_supported():
        return None
    kernels = ["vnni_linear", "vnni_linear_silu"]
    if hasattr(library, "vnni_linear_avx512"):  # an older copy may not have it
        kernels.append("vnni_linear_avx512")
    for name in kernels:
        getattr(library, name).argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        getattr(library, name).restype = ctypes.c_int
    library.vnni_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    library.vnni_pack.restype = ctypes.c_int
    if hasattr(library, "vnni_rows"):  # an older copy may not have it
        library.vnni_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_void_p]
        library.vnni_rows.restype = ctypes.c_int
    return library


def vnni_supports(weight: torch.Tensor) -> bool:
    """Whether vnni_linear takes this (N, K) weight: bf16 on CPU, contiguous, N and K multiples of 32."""
    return supports(weight) and weight.shape[0] % 32 == 0 and weight.is_contiguous()


def vnni_pack_(library: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """Reorder weight (N, K) in place into VNNI order; returns it viewed as (N / 16, K / 2, 16, 2).

    In place: the weight's storage now holds the new order, so whatever shares it must read that order (a
    head tied to the embedding: VocabParallelEmbedding.share_with_head)."""
    n, k = weight.shape
    if library.vnni_pack(weight.data_ptr(), n, k) != 0:
        raise MemoryError(f"vnni_pack: no memory for a {16 * k * 2}-byte buffer")
    return weight.view(n // 16, k // 2, 16, 2)


def vnni_rows(library: ctypes.CDLL, packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (any shape, int64 on the CPU) of a weight from vnni_pack_, as plain rows: (*ids.shape, K) bf16,
    F.embedding's result on the weight before it was reordered. Raises IndexError for an id outside it."""
    n, k = packed.shape[0] * 16, packed.shape[1] * 2
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.shape[0], k, dtype=torch.bfloat16)
    if library.vnni_rows(packed.data_ptr(), n, k, flat.data_ptr(), flat.shape[0], out.data_ptr()) != 0:
        raise IndexError(f"vnni_rows: an id outside the {n} rows of the table")
    return out.view(*ids.shape, k)


def supports(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.shape[1] % 32 == 0


def small_batch_linear(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: (..., K) bf16; weight: (N, K) bf16, contiguous. Returns x @ weight.T, (..., N) bf16."""
    return _call(library.small_batch_linear, x, weight)


def amx_linear(library: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """As small_batch_linear, on AMX tiles (N a multiple of 32 too)."""
    return _call(library.amx_linear, x, weight)


def vnni_linear(library: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x: (..., K) bf16; packed: a weight from vnni_pack_, (N / 16, K / 2, 16, 2). Returns x @ W.T, (..., N) bf16."""
    return _call(library.vnni_linear, x, packed, packed.shape[0] * 16, packed.shape[1] * 2)


def vnni_linear_avx512(library: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """vnni_linear as a CPU without AMX runs it (AVX512-BF16 register tiles from three rows), on any CPU
    with AVX512-BF16."""
    return _call(library.vnni_linear_avx512, x, packed, packed.shape[0] * 16, packed.shape[1] * 2)


def vnni_linear_silu(library: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x: (..., K) bf16; packed: a gate/up weight from vnni_pack_, its N / 2 gate rows first. Returns
    F.silu(gate) * up on gate, up = (x @ W.T).chunk(2, -1), (..., N / 2) bf16, with the same roundings."""
    if packed.shape[0] % 2:
        raise ValueError(f"vnni_linear_silu: {packed.shape[0] * 16} outputs do not split into gate and up blocks")
    return _call(library.vnni_linear_silu, x, packed, packed.shape[0] * 8, packed.shape[1] * 2)


def _call(kernel, x: torch.Tensor, weight: torch.Tensor, n: int | None = None, k: int | None = None) -> torch.Tensor:
    n, k = (weight.shape[0], weight.shape[1]) if n is None else (n, k)
    # A decode step's activations are already (rows, K) and contiguous: no reshape or view ops then.
    flat = x.dim() == 2 and x.is_contiguous()
    rows = x if flat else x.reshape(-1, x.shape[-1]).contiguous()
    if rows.shape[1] != k:
        raise ValueError(f"{kernel.__name__}: inputs of width {rows.shape[1]} for a weight of {k} inputs")
    out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
    status = kernel(rows.data_ptr(), weight.data_ptr(), out.data_ptr(), rows.shape[0], n, k)
    if status != 0:
        raise RuntimeError(f"{kernel.__name__} failed with status {status} for {tuple(rows.shape)} x ({n}, {k})")
    return out if flat else out.view(*x.shape[:-1], n)
