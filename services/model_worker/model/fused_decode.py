"""Decode steps through every layer in one C call, where the model and the step allow it; on kernels that take any
row count, steps with prompts in them too.

On CPU in bf16 a decode step's arithmetic already runs in C kernels (matmuls, norms, attention);
what the layer-by-layer forward adds around them is Python: about 0.2 ms a layer of module calls,
views, adds and ctypes calls, 5-6 ms of a 0.6B model's step. FusedDecode hands the whole layer
loop to kernels/decoder.c, which calls the same kernels in the same order and rounds as torch, so
the hidden states are the same bit for bit. Where every matmul's kernel takes any row count (bf16 weights
in VNNI order, or int8 weights times int8 activations) and prompts have the C prefill attention kernel,
decode steps of any size, prefill and mixed steps run there too: a fresh 128-token prompt then prefills in
0.94x the time. Over an 8-bit KV cache (fp8, int8) decode steps read it with the layer's scales, and a
prompt's keys are dequantized from it for the prefill kernel as the layers gather them. Anything it does
not take (more decode rows than the matmul kernels take, plain bf16, fp8 or int8-with-bf16-activation
weights with prompts in the step, another attention backend) runs the layers as before.
Steps with LoRA adapter rows run here too, each target matmul followed by lora.c's SGMV as the
layers' add_lora calls it (under tensor parallelism there is no fused loop: those run layer by layer).
"""
from __future__ import annotations

import ctypes
import logging

import torch

from services.model_worker.kernels import cpu_attention, cpu_decoder, cpu_lora
from services.model_worker.model.layers.attention.cpu_paged import CpuPagedAttention
from services.model_worker.model.layers.attention.kv_quant import scales_of
from services.model_worker.model.layers.attention.metadata import AttentionMetadata
from services.model_worker.model.layers.linear import SmallBatchLinearMethod
from services.model_worker.model.layers.quant.eight_bit import SCALE, EightBitLinearMethod
from services.model_worker.model.layers.norm import RMSNorm
from services.model_worker.model.qwen3 import Qwen3MLP, Qwen3Model

log = logging.getLogger(__name__)


def _layer_linears(layer) -> tuple:
    """A decoder layer's four matmuls, in the order decode_layers runs them."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _linears(model: Qwen3Model) -> list:
    return [m for layer in model.layers for m in _layer_linears(layer)]


class FusedDecode:
    """The layers of one Qwen3Model, run by decode_layers for the pure decode steps it takes."""

    def __init__(self, library: ctypes.CDLL, model: Qwen3Model):
        self.library = library
        self.model = model
        first = model.layers[0]
        attn, mlp = first.self_attn, first.mlp
        linears = _linears(model)
        # 8-bit layers (EightBitLinearMethod on its C kernels) or bf16 ones (SmallBatchLinearMethod).
        self.q8 = linears[0].q8 if isinstance(linears[0].method, EightBitLinearMethod) else None
        # int8 x int8 (w8a8_linear.c): on AMX-INT8 or on VNNI, at every row count.
        self.w8a8_amx = self.q8 is not None and linears[0].w8a8_amx
        self.w8a8_vnni = self.q8 is not None and linears[0].w8a8_vnni
        if self.q8 is not None:
            amx = all(m.q8_amx for m in linears)
            self.max_rows = EightBitLinearMethod.AMX_MAX_ROWS if amx else EightBitLinearMethod.NO_AMX_MAX_ROWS
            self.small_library = self.amx_library = None
        # Weights in VNNI order (VnniLinearMethod): vnni_linear takes every row count, in place of both kernels
        # (AMX tiles, or AVX512-BF16 register tiles on CPUs without AMX).
        self.vnni = getattr(linears[0], "vnni", None)
        if self.q8 is None:
            self.max_rows = SmallBatchLinearMethod.AMX_MAX_ROWS \
                if self.vnni is not None or all(m.amx is not None for m in linears) else SmallBatchLinearMethod.MAX_ROWS
            self.small_library, self.amx_library = linears[0].kernel, linears[0].method.amx
        self.norm_library = first.input_layernorm.kernel
        self.shape = dict(hidden=first.input_layernorm.weight.shape[0], heads=attn.num_heads,
                          kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, intermediate=mlp.intermediate_size,
                          eps=first.input_layernorm.eps, scale=attn.scale)
        # Steps with prompts, on kernels that take any row count: bf16 weights in VNNI order, or int8 weights times
        # int8 activations (w8a8_linear.c, on VNNI or AMX-INT8). fp8, and int8 with bf16 activations, route by rows
        # up to max_rows. A switch, so benchmarks can run those steps layer by layer.
        self.prompts = (self.vnni is not None and self.q8 is None) or self.w8a8_amx or self.w8a8_vnni
        if self.prompts:  # and decode steps of any size too, as the layers would run them on the same kernel
            self.max_rows = 2 ** 30
        self._layers: tuple | None = None     # (cache key, ctypes array, tensors it points into)
        self._kernels: tuple | None = None    # ((attention backend, LoRA kernel), Kernels)

    @classmethod
    def build(cls, model: Qwen3Model, library: ctypes.CDLL | None) -> "FusedDecode | None":
        """The fused loop for this model (library: decoder.c), or None where there is no library or the
        layers are not all on the C kernels it calls."""
        layers = list(model.layers)
        if not all(isinstance(layer.mlp, Qwen3MLP) for layer in layers):
            return None  # decoder.c runs dense MLPs only: experts go layer by layer (model/qwen3_moe.py)
        if not layers or model.embed_tokens.weight.dtype != torch.bfloat16 \
                or model.embed_tokens.weight.device.type != "cpu":
            return None
        linears = _linears(model)
        norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
        method = linears[0].method
        bf16 = all(isinstance(m.method, SmallBatchLinearMethod) and m.kernel is not None for m in linears)
        eight_bit = all(isinstance(m.method, EightBitLinearMethod) and m.q8 is not None for m in linears)
        if not ((bf16 or eight_bit) and all(m.method is method and m.bias is None for m in linears)):
            return None
        if eight_bit and len({(m.w8a8_amx, m.w8a8_vnni) for m in linears}) != 1:
            return None  # some layers on the int8 x int8 kernels and some not: one routing table cannot say it
        if bf16 and len({getattr(m, "vnni", None) is None for m in linears}) != 1:
            return None  # some weights reordered and some plain: one kernel table cannot take both
        if any(m.tp.size != 1 for m in linears):
            return None
        if not all(n.kernel is not None and n.kernel is norms[0].kernel and n.eps == norms[0].eps for n in norms):
            return None
        return None if library is None else cls(library, model)

    def takes(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A pure decode step (one new token per sequence) of few enough rows, on the C attention kernel."""
        return (meta.max_query_len == 1 and isinstance(meta.backend, CpuPagedAttention)
                and 1 <= hidden.shape[0] <= self.max_rows and hidden.dtype == torch.bfloat16
                and hidden.is_contiguous() and meta.context_lens.shape[0] == hidden.shape[0])

    def takes_prompts(self, hidden: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A step with prompts in it (alone, or beside decoding sequences), on weights whose kernels take every row
        count, the C attention kernels for both and bf16 rows; an 8-bit cache's rows are dequantized for the
        prefill kernel in the loop, as the layers gather them."""
        return (self.prompts and meta.max_query_len > 1 and meta.prefill is not None
                and isinstance(meta.backend, CpuPagedAttention) and meta.backend.prefill_library is not None
                and self.shape["head_dim"] % 32 == 0 and hidden.dtype == torch.bfloat16 and hidden.is_contiguous())

    @staticmethod
    def takes_lora() -> bool:
        """Steps with adapter rows: where lora.c builds, the kernel the layers' add_lora would call (else they
        take the torch SGMV, whose sums this loop does not repeat)."""
        return cpu_lora.load() is not None

    def __call__(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                 keep: torch.Tensor | None = None) -> None:
        """Every layer on hidden (rows, hidden_size), in place, as the layer-by-layer forward would.

        keep: in a step with prompts, the rows whose final hidden states are wanted (ascending, int64; not with
        adapter rows): the last layer's output projection and MLP run on those alone, as Qwen3Model.forward's
        layers do with the same rows; the other rows come out undefined."""
        array, shape = self._layer_array(kv_caches, meta.block_size)
        state = self.model.lora
        batch = state.batch if state is not None else None
        kernels = self._kernel_table(meta.backend)
        lora = cpu_decoder.LoraRows.of(batch) if batch is not None else None
        rope = tuple(t.contiguous() for t in rope)
        if meta.max_query_len == 1:
            cpu_decoder.decode_layers(self.library, kernels, shape, array, hidden, rope, meta.slot_mapping.contiguous(),
                                      meta.context_lens.contiguous(), meta.block_tables.contiguous(), lora)
            return
        layout = meta.prefill
        prompts = [(start, n, None if slots is None else slots.contiguous())
                   for start, n, slots in zip(layout.starts, layout.lens, layout.key_slots)]
        seqs = meta.decode_seqs
        prompt_layout = cpu_decoder.PromptLayout(prompts, meta.decode_rows.contiguous(),
                                                 meta.context_lens[seqs].contiguous(),
                                                 meta.block_tables[seqs].contiguous())
        cpu_decoder.prompt_layers(self.library, kernels, shape, array, hidden, rope, meta.slot_mapping.contiguous(),
                                  prompt_layout, lora, None if keep is None else keep.contiguous())

    def _kernel_table(self, backend: CpuPagedAttention) -> cpu_decoder.Kernels:
        attention_library = backend.library
        # The LoRA kernel where the model has adapter slots: a worker without them never builds lora.c.
        sgmv_library = cpu_lora.load() if self.model.lora is not None else None
        if self._kernels is None or self._kernels[0][0] is not backend or self._kernels[0][1] is not sgmv_library:
            address = cpu_decoder.address
            amx = address(self.amx_library, "amx_linear") if self.amx_library is not None else None
            small = address(self.small_library, "small_batch_linear") if self.small_library is not None else None
            if self.vnni is not None:
                small = amx = address(self.vnni, "vnni_linear")
            q8 = address(self.q8.library, "q8_linear") if self.q8 is not None else None
            q8_amx = address(self.q8.library, "q8_linear_amx") if self.q8 is not None and self.q8.amx else None
            if self.w8a8_amx:  # the AMX-INT8 kernel at every row count, as EightBitLinearMethod routes it
                q8 = q8_amx = address(self.q8.w8a8, "w8a8_linear_amx")
            elif self.w8a8_vnni:
                q8 = address(self.q8.w8a8, "w8a8_linear")  # every row count; without AMX, never q8_amx
            amx_max_rows = EightBitLinearMethod.AMX_MAX_ROWS if self.q8 is not None else SmallBatchLinearMethod.AMX_MAX_ROWS
            q8_no_amx_max_rows = EightBitLinearMethod.NO_AMX_MAX_ROWS
            max_rows, prefill, linear_silu = self.max_rows, None, None
            if self.prompts:  # vnni_linear, or w8a8_linear, at every row count
                amx_max_rows = max_rows = q8_no_amx_max_rows = 2 ** 30
                if self.q8 is None:
                    linear_silu = address(self.vnni, "vnni_linear_silu")
                if backend.prefill_library is not None:
                    prefill = address(backend.prefill_library, "prefill_attention")
            table = cpu_decoder.Kernels(
                small, amx, address(self.norm_library, "rms_norm"),
                address(self.norm_library, "rms_norm_rope"), address(attention_library, "write_kv_quant"),
                address(attention_library, "paged_decode_attention_kv"), SmallBatchLinearMethod.MAX_ROWS,
                SmallBatchLinearMethod.AMX_MIN_ROWS, amx_max_rows, q8, q8_amx, EightBitLinearMethod.GEMV_MAX_ROWS,
                q8_no_amx_max_rows, max_rows, prefill, linear_silu,
                address(sgmv_library, "lora_sgmv") if sgmv_library is not None else None)
            self._kernels = ((backend, sgmv_library), table)
        return self._kernels[1]

    def _layer_array(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> tuple:
        """(ctypes Layer array, Shape), built once for these caches; the tensors it points into are kept alive."""
        # The adapter slots are allocated once, with the model's LoraState: their tensors never move.
        key = tuple((cache[0].data_ptr(), cache[1].data_ptr(), cache[0].shape, cache[0].dtype,
                     *(s.data_ptr() for s in scales_of(cache).values())) for cache in kv_caches) + \
            (block_size, self.model.lora)
        if self._layers is None or self._layers[0] != key:
            array, kept = (cpu_decoder.Layer * len(self.model.layers))(), []
            for i, (layer, cache) in enumerate(zip(self.model.layers, kv_caches)):
                attn = layer.self_attn
                k_cache, v_cache = cache
                kv_kind = cpu_attention.KV_KINDS.get(k_cache.dtype, 0)
                kv_scales = (getattr(cache, "k_scale", None), getattr(cache, "v_scale", None))
                if not (k_cache.is_contiguous() and v_cache.is_contiguous()
                        and (k_cache.dtype == torch.bfloat16 or kv_kind) and v_cache.dtype == k_cache.dtype):
                    raise ValueError("the fused decode loop needs contiguous bf16 or 8-bit caches")
                if kv_kind and not all(s is not None and s.dtype == torch.float32 and s.is_contiguous()
                                       for s in kv_scales):
                    raise ValueError("an 8-bit cache needs its contiguous float32 scales")
                linears = _layer_linears(layer)
                qkv, o, gate_up, down = (m.vnni_weight if self.vnni is not None else m.weight for m in linears)
                tensors = (layer.input_layernorm.weight, qkv, attn.qk_norm_weight(), o,
                           layer.post_attention_layernorm.weight, gate_up, down)
                byte_weights = {id(m.weight) for m in linears} if self.q8 is not None else set()
                if not all(t.is_contiguous() and (t.dtype == torch.bfloat16 or id(t) in byte_weights)
                           for t in tensors):
                    raise ValueError("the fused decode loop needs contiguous bf16 (or 8-bit matmul) weights")
                kept.extend(tensors)
                if self.q8 is not None:
                    scales = [getattr(m, SCALE) for m in linears]
                    kept.extend(scales)
                    flags = [int(m.q8_amx or m.w8a8_amx) for m in linears]
                    extra = [s.data_ptr() for s in scales] + [int(linears[0].weight.dtype == torch.float8_e4m3fn)]
                else:
                    flags = [int(m.amx is not None or self.vnni is not None) for m in linears]
                    extra = [None] * 4 + [0]
                scale_ptrs = [s.data_ptr() for s in kv_scales] if kv_kind else [None, None]
                kept.extend(s for s in kv_scales if s is not None)
                lora = [_lora_linear(m.lora, kept) for m in linears]
                array[i] = cpu_decoder.Layer(*(t.data_ptr() for t in tensors), k_cache.data_ptr(), v_cache.data_ptr(),
                                             *flags, *extra, kv_kind, *scale_ptrs, (cpu_decoder.LoraLinear * 4)(*lora))
            num_slots = kv_caches[0][0].shape[1]
            shape = cpu_decoder.Shape(num_slots=num_slots, block_size=block_size, **self.shape)
            self._layers = (key, (array, shape), kept)
        return self._layers[1]


def _lora_linear(slots, kept: list) -> cpu_decoder.LoraLinear:
    """A linear layer's adapter slots (LoraSlots, or None: none) as decoder.c reads them; what it points into
    is added to kept."""
    if slots is None:
        return cpu_decoder.LoraLinear()
    if not (slots.a.dtype == slots.b.dtype == torch.bfloat16 and slots.a.is_contiguous() and slots.b.is_contiguous()):
        raise ValueError("the fused decode loop needs contiguous bf16 adapter slots")
    ends = torch.tensor(slots.part_ends, dtype=torch.int64)
    kept.extend((slots.a, slots.b, ends))
    return cpu_decoder.LoraLinear(slots.a.data_ptr(), slots.b.data_ptr(), ends.data_ptr(), len(slots.part_ends),
                                  slots.b.shape[1])


def use_activation_kernel(model: torch.nn.Module, library: ctypes.CDLL) -> int:
    """Point every dense MLP's SiLU-and-product at decoder.c's (bit for bit torch's); returns how many."""
    mlps = [m for m in model.modules() if isinstance(m, Qwen3MLP)]
    for mlp in mlps:
        mlp.act_kernel = library
    return len(mlps)


def use_fused_decode(model: Qwen3Model, library: ctypes.CDLL | None) -> bool:
    """Give the model the fused decode loop (decoder.c, loaded by cpu_decoder.load; None: there is none)
    where it applies; returns whether it did."""
    model.fused_decode = FusedDecode.build(model, library)
    log.info("fused decode layers (one C call a decode step): %s", "yes" if model.fused_decode else "no")
    return model.fused_decode is not None
