"""Builds paged_attention.c with the system C compiler on first use and calls it through ctypes.

The library is compiled for the machine it runs on (-march=native) and cached under a name
that hashes the source, the flags and the CPU's feature list, so a changed kernel or another
CPU gets a fresh build. It links torch's own OpenMP runtime, so the kernel's threads are the
same pool (and the same thread count) as torch's. Without a compiler the worker runs the
plain-PyTorch path instead, and says so in its log.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import torch

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("paged_attention.c")
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared", "-fopenmp"]
_ARGTYPES = [ctypes.c_void_p] * 6 + [ctypes.c_int64] + [ctypes.c_int] * 7 + [ctypes.c_float]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def cache_dir() -> pathlib.Path:
    root = os.environ.get("VLLM_V0_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                          os.path.expanduser("~/.cache"), "vllm_v0")
    return pathlib.Path(root) / "kernels"


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def build(compiler: str | None = None) -> pathlib.Path:
    """Compile the kernel (or find it already compiled); raises RuntimeError if that fails."""
    compiler = compiler or os.environ.get("CC") or "gcc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler: {compiler!r} is not on PATH (set CC to use another)")
    torch_lib = pathlib.Path(torch.__file__).parent / "lib"
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(),
                                     platform.machine().encode(), _cpu_features().encode(),
                                     str(torch_lib).encode()])).hexdigest()[:16]
    target = cache_dir() / f"paged_attention-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = pathlib.Path(tmp) / target.name
        # torch's bundled libgomp when it has one: two OpenMP runtimes in a process would each
        # keep a team of spinning threads on the same cores.
        gomp = [f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"] if (torch_lib / "libgomp.so.1").exists() else []
        cmd = [compiler, *FLAGS, str(SOURCE), "-o", str(out), *gomp, "-lgomp", "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr.strip()}")
        os.replace(out, target)  # atomic: a concurrent build of the same key writes the same file
    return target


def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None (with a warning) where it cannot be built."""
    try:
        library = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        log.warning("CPU attention kernel unavailable, using the PyTorch path (slower): %s", e)
        return None
    library.paged_decode_attention.argtypes = _ARGTYPES
    library.paged_decode_attention.restype = ctypes.c_int
    return library


def supports(dtype: torch.dtype) -> bool:
    return dtype in _DTYPES


def paged_decode_attention(library: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           context_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                           scale: float) -> torch.Tensor:
    """q: (N, H, D), the last position of each of N sequences; caches: (Hkv, slots, D) on the CPU.

    context_lens: (N,) int32, >= 1; block_tables: (N, max_blocks) int32. Returns (N, H, D).
    """
    q = q.contiguous()
    context_lens, block_tables = context_lens.contiguous(), block_tables.contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert context_lens.dtype == block_tables.dtype == torch.int32
    out = torch.empty_like(q)
    num_seqs, num_heads, head_dim = q.shape
    status = library.paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), context_lens.data_ptr(),
        block_tables.data_ptr(), k_cache.shape[1], num_seqs, num_heads, k_cache.shape[0], head_dim, block_size,
        block_tables.shape[1], _DTYPES[q.dtype], scale)
    if status != 0:
        raise RuntimeError(f"paged_decode_attention failed with status {status} "
                           f"(heads {num_heads}, KV heads {k_cache.shape[0]}, head_dim {head_dim})")
    return out
