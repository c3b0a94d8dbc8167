"""Every decoder layer of a bf16 CPU step in one C call (decoder.c), through ctypes.

The C loop calls the same matmul, norm and attention kernels as the layer-by-layer forward, through
function pointers taken from their libraries here, and rounds the ops torch did (adds, SiLU, the
gate product) as torch does: the fused step's hidden states equal the unfused step's bit for bit.
A step with LoRA adapter rows adds their products after each target matmul with lora.c's SGMV, the
kernel the unfused path's add_lora calls.
"""
from __future__ import annotations

import ctypes
import pathlib

import torch

from services.model_worker.kernels import build

SOURCE = pathlib.Path(__file__).with_name("decoder.c")


class Kernels(ctypes.Structure):
    _fields_ = [("small", ctypes.c_void_p), ("amx", ctypes.c_void_p), ("norm", ctypes.c_void_p),
                ("norm_rope", ctypes.c_void_p), ("write_kv", ctypes.c_void_p), ("attention", ctypes.c_void_p),
                ("small_max_rows", ctypes.c_int), ("amx_min_rows", ctypes.c_int), ("amx_max_rows", ctypes.c_int),
                ("q8", ctypes.c_void_p), ("q8_amx", ctypes.c_void_p), ("q8_small_max_rows", ctypes.c_int),
                ("q8_no_amx_max_rows", ctypes.c_int), ("max_rows", ctypes.c_int), ("prefill", ctypes.c_void_p),
                ("linear_silu", ctypes.c_void_p), ("sgmv", ctypes.c_void_p)]


class Shape(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("intermediate", ctypes.c_int), ("block_size", ctypes.c_int),
                ("num_slots", ctypes.c_int64), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class LoraLinear(ctypes.Structure):
    """One linear layer's adapter slots (LoraSlots: a, b, part_ends); a None where it has none."""
    _fields_ = [("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("part_ends", ctypes.c_void_p),
                ("num_parts", ctypes.c_int64), ("width", ctypes.c_int64)]


class LoraRows(ctypes.Structure):
    """A step's adapter rows grouped by slot (LoraBatch)."""
    _fields_ = [("rows", ctypes.c_void_p), ("starts", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("ranks", ctypes.c_void_p), ("segments", ctypes.c_int64)]

    @classmethod
    def of(cls, batch) -> "LoraRows":
        """batch: a LoraBatch on the host, its tensors contiguous int64 (as LoraBatch.build makes them)."""
        return cls(batch.rows.data_ptr(), batch.starts.data_ptr(), batch.slots.data_ptr(), batch.ranks.data_ptr(),
                   batch.num_segments)


class Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("input_norm", "qkv", "qk_norm", "o", "post_norm", "gate_up",
                                                     "down", "k_cache", "v_cache")] + \
               [(name, ctypes.c_int) for name in ("qkv_amx", "o_amx", "gate_up_amx", "down_amx")] + \
               [(name, ctypes.c_void_p) for name in ("qkv_scale", "o_scale", "gate_up_scale", "down_scale")] + \
               [("fp8", ctypes.c_int), ("kv_kind", ctypes.c_int), ("k_scale", ctypes.c_void_p),
                ("v_scale", ctypes.c_void_p), ("lora", LoraLinear * 4)]  # qkv, o, gate_up, down


class Prompts(ctypes.Structure):
    _fields_ = [("count", ctypes.c_int), ("starts", ctypes.c_void_p), ("lens", ctypes.c_void_p),
                ("keys", ctypes.c_void_p), ("key_slots", ctypes.c_void_p), ("decodes", ctypes.c_int),
                ("max_blocks", ctypes.c_int), ("decode_rows", ctypes.c_void_p), ("context_lens", ctypes.c_void_p),
                ("block_tables", ctypes.c_void_p)]


class Step(ctypes.Structure):
    _fields_ = [("rows", ctypes.c_int), ("max_blocks", ctypes.c_int), ("cos", ctypes.c_void_p),
                ("signed_sin", ctypes.c_void_p), ("slots", ctypes.c_void_p), ("context_lens", ctypes.c_void_p),
                ("block_tables", ctypes.c_void_p), ("prompts", ctypes.c_void_p), ("lora", ctypes.c_void_p),
                ("keep", ctypes.c_void_p), ("keep_count", ctypes.c_int)]


def load() -> ctypes.CDLL | None:
    """The compiled loop; None (with a warning) where it cannot be built or the CPU has no AVX-512."""
    library = build.load(SOURCE, "fused decode layers")
    if library is None or not library.decoder_supported():
        return None
    library.run_layers.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                   ctypes.c_void_p, ctypes.c_void_p]
    library.run_layers.restype = ctypes.c_int
    library.silu_and_mul.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    library.silu_and_mul.restype = ctypes.c_int
    return library


def silu_and_mul(library: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor | None:
    """F.silu(gate) * up for gate_up = [gate | up], (rows, 2 n) bf16 and contiguous, with the same two
    roundings to bf16; None where the kernel does not take the shape (n not a multiple of 16)."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    act = torch.empty(rows, n, dtype=torch.bfloat16)
    if library.silu_and_mul(gate_up.data_ptr(), act.data_ptr(), rows, n) != 0:
        return None
    return act


def address(library: ctypes.CDLL, name: str) -> int:
    """The address of a C function in a loaded library, to hand to run_layers."""
    return ctypes.cast(getattr(library, name), ctypes.c_void_p).value


def decode_layers(library: ctypes.CDLL, kernels: Kernels, shape: Shape, layers: ctypes.Array, hidden: torch.Tensor,
                  rope: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor, context_lens: torch.Tensor,
                  block_tables: torch.Tensor, lora: LoraRows | None = None) -> None:
    """Run every layer on hidden, (rows, hidden) contiguous bf16, in place: one new token per row.

    rope: (rows, 1, head_dim) bf16 tables; slot_mapping (rows,) int64; context_lens (rows,) int32;
    block_tables (rows, max_blocks) int32; all contiguous on the CPU. lora: the step's adapter rows, if any.
    """
    cos, signed_sin = rope
    step = Step(hidden.shape[0], block_tables.shape[1], cos.data_ptr(), signed_sin.data_ptr(),
                slot_mapping.data_ptr(), context_lens.data_ptr(), block_tables.data_ptr(), None,
                None if lora is None else ctypes.addressof(lora))
    _run(library, kernels, shape, layers, step, hidden, "decode_layers")


class PromptLayout:
    """A step with prompts in it, as run_layers reads it (Prompts); the tensors it points into are kept here.

    prompts: (first row, rows, key slots (keys,) int64 contiguous or None for a fresh prompt) of each
    sequence with more than one new row; decode_rows (Bd,) int64 the one-row sequences' rows, with their
    context_lens (Bd,) and block_tables (Bd, max_blocks) int32, contiguous.
    """

    def __init__(self, prompts: list[tuple[int, int, torch.Tensor | None]], decode_rows: torch.Tensor,
                 context_lens: torch.Tensor, block_tables: torch.Tensor):
        count = len(prompts)
        self.starts = (ctypes.c_int32 * count)(*(start for start, _, _ in prompts))
        self.lens = (ctypes.c_int32 * count)(*(n for _, n, _ in prompts))
        self.keys = (ctypes.c_int32 * count)(*(n if slots is None else slots.shape[0] for _, n, slots in prompts))
        self.key_slots = (ctypes.c_void_p * count)(*(None if slots is None else slots.data_ptr()
                                                     for _, _, slots in prompts))
        self.kept = (decode_rows, context_lens, block_tables, [slots for _, _, slots in prompts])
        self.struct = Prompts(count, ctypes.addressof(self.starts), ctypes.addressof(self.lens),
                              ctypes.addressof(self.keys), ctypes.addressof(self.key_slots), decode_rows.shape[0],
                              block_tables.shape[1], decode_rows.data_ptr(), context_lens.data_ptr(),
                              block_tables.data_ptr())


def prompt_layers(library: ctypes.CDLL, kernels: Kernels, shape: Shape, layers: ctypes.Array, hidden: torch.Tensor,
                  rope: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor, layout: PromptLayout,
                  lora: LoraRows | None = None, keep: torch.Tensor | None = None) -> None:
    """Run every layer on hidden, (rows, hidden) contiguous bf16, in place, for a step with prompts in it.

    rope: (rows, 1, head_dim) bf16 tables; slot_mapping (rows,) int64, contiguous on the CPU; lora: the step's
    adapter rows, if any. keep: the rows whose final hidden states are wanted, (K,) int64 ascending and
    contiguous (not with lora): the last layer's output projection and MLP run on those alone, and the other
    rows of hidden come out undefined. None: every row.
    """
    cos, signed_sin = rope
    step = Step(hidden.shape[0], 0, cos.data_ptr(), signed_sin.data_ptr(), slot_mapping.data_ptr(), None, None,
                ctypes.addressof(layout.struct), None if lora is None else ctypes.addressof(lora),
                None if keep is None else keep.data_ptr(), 0 if keep is None else keep.shape[0])
    _run(library, kernels, shape, layers, step, hidden, "prompt_layers")


def _run(library: ctypes.CDLL, kernels: Kernels, shape: Shape, layers: ctypes.Array, step: Step, hidden: torch.Tensor,
         name: str) -> None:
    status = library.run_layers(ctypes.addressof(kernels), ctypes.addressof(shape), ctypes.addressof(layers),
                                len(layers), ctypes.addressof(step), hidden.data_ptr())
    if status in (-3, -4):  # paged_attention.c's refusal of a block table (or prefill_attention.c's of a slot)
        raise IndexError(f"{name}: a block table or key slot reaches outside the KV cache (status {status})")
    if status != 0:
        raise RuntimeError(f"{name} failed with status {status} for {hidden.shape[0]} rows")
