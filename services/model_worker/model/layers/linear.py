"""Linear layers and the seam where weight formats plug in.

A layer knows its shape and its tensor-parallel split, and reads its slice of each checkpoint
tensor (weight_loader). How its weights are stored and multiplied is a LinearMethod: create the
parameters, process them once loaded, apply them to an input. The model file never names a
format; the executor picks the method for the device before the model is built, as vLLM's
LinearMethodBase and nano-vllm's layers/linear.py split the work. A new format (8-bit weights, say)
is one more method here.

Methods today, all exact for bf16 (fp32 packing differs in summation order only):
- PlainLinearMethod: F.linear on the weight as loaded; every device and dtype.
- PackedLinearMethod: CPU, the weight reordered once into oneDNN's blocked layout.
- SmallBatchLinearMethod: CPU bf16, decode-sized matmuls in C kernels on the plain weight.
- VnniLinearMethod: CPU bf16 with AMX, every matmul in C kernels on the weight reordered in place.
8-bit weights (fp8 blocks, int8 rows) are methods of their own in quant/.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from services.model_worker.distributed.parallel import TensorParallel
from services.model_worker.kernels import cpu_linear
from services.model_worker.model.layers.weights import CheckpointTensor, read_whole, split_rows

log = logging.getLogger(__name__)

# oneDNN lays a packed weight out for this many input rows (other row counts still run correctly).
# A decode step has one row per running sequence. Measured on the engine (0.6B shape, bf16, Xeon
# with AMX, weights streamed from memory): a layout for 16 rows decoded one sequence in 121 ms a
# step against 165 ms for a layout for 1 row (and 136 ms unpacked), and it is the batch serving runs.
DECODE_ROWS_HINT = 16


class LinearMethod:
    """How a linear layer's weights are held and applied. One object serves every layer that uses it."""

    name = "base"

    def create_weights(self, layer: LinearBase, in_features: int, out_features: int, bias: bool) -> None:
        """The parameters the checkpoint fills: weight (out, in) and an optional bias (out,)."""
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def checkpoint_tensor(self, layer: LinearBase, leaf: str, source: CheckpointTensor, rows: int) -> CheckpointTensor:
        """The checkpoint tensor that fills `leaf`, as the layer's weight_loader reads it; rows: its first
        dimension over all ranks. A format whose tensors are laid out per block (8-bit scales) maps them here."""
        return source

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Turn the loaded weights into this method's form (once, before the first forward)."""

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply_silu_and_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
        """F.silu(gate) * up of a gate/up layer (its outputs: gate, then up, of one width) in one pass,
        with the same bits as apply and the activation apart; None where this method has no such pass."""
        return None

    def head_method(self) -> LinearMethod:
        """The method for the vocab projection, which may share its weight with the embedding."""
        return self


class PlainLinearMethod(LinearMethod):
    """The weight as the checkpoint has it, multiplied by F.linear."""

    name = "plain"

    def apply(self, layer, x):
        return F.linear(x, layer.weight, layer.bias)


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


class PackedLinearMethod(LinearMethod):
    """The weight reordered once into oneDNN's blocked layout (CPU, bf16 or float32).

    F.linear hands oneDNN a plain row-major weight, which it re-blocks on the fly at every call;
    reading a pre-blocked one is what makes a small-batch matmul run near memory speed. These are
    the ops inductor's weight freezing emits (torch/_inductor/fx_passes/mkldnn_fusion.py). bf16
    results are bit-identical to F.linear's; fp32 ones differ in summation order only.

    The plain weight is dropped from the layer once packed; a head tied to the embedding gets a
    packed copy of its own (the embedding keeps the plain table), which costs vocab x hidden more
    memory.
    """

    name = "onednn-packed"

    def process_weights_after_loading(self, layer):
        # A plain attribute, not a buffer: an opaque oneDNN tensor has no place in a state dict.
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), DECODE_ROWS_HINT)
        layer.weight = None

    def apply(self, layer, x):
        return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")


class SmallBatchLinearMethod(LinearMethod):
    """bf16 on CPU: the matmuls of decode-sized batches in C kernels, on the plain weight.

    A decode step of up to a few dozen sequences only streams the weights: the small-batch kernel
    (kernels/small_batch_linear.c) does that at close to memory speed for one or two rows, the AMX
    kernel (kernels/amx_linear.c) from there to 32 rows, and oneDNN at about half that speed. Short
    prefills are compute-bound, and the AMX kernel still beats oneDNN on plain weights there, up to
    AMX_PREFILL_MAX_ROWS; longer ones go to F.linear. The weight stays in its plain layout, shared
    with the checkpoint's tensor: no second copy. A layer whose shape the kernels do not take runs
    F.linear.
    """

    name = "small-batch"
    # The AVX512-BF16 kernel in the fused decode loop: faster than oneDNN up to 4 rows, slower from 8. Layer
    # by layer, the kernel says how many rows it takes at a layer's input width (more without AMX).
    MAX_ROWS = 4
    AMX_MIN_ROWS = 3   # measured: the AMX kernel beats the AVX512-BF16 one from 3 rows
    # The fused decode loop (model/fused_decode.py) takes decode batches up to this many rows.
    AMX_MAX_ROWS = 128
    # Measured on the 0.6B model's weights, 28 layers streamed, layer by layer alternating with oneDNN
    # (bench/bench_prefill_matmul.py): since the AMX kernel copies each weight block in tile order on
    # its first pass (from 65 rows), it takes 0.67-0.75x oneDNN's time at 64 rows, 0.77-0.82x at 128,
    # 0.86-0.92x at 256 and 0.96-1.05x at 384.
    AMX_PREFILL_MAX_ROWS = 256

    def __init__(self, library, amx=None):
        self.library = library
        self.amx = amx

    def process_weights_after_loading(self, layer):
        layer.kernel = self.library if cpu_linear.supports(layer.weight) else None
        layer.small_rows = cpu_linear.small_batch_max_rows(layer.kernel, layer.weight.shape[1]) \
            if layer.kernel is not None else 0
        # AMX tiles cover 32 outputs at a time.
        layer.amx = self.amx if layer.kernel is not None and layer.weight.shape[0] % 32 == 0 else None

    def apply(self, layer, x):
        rows = x.numel() // x.shape[-1]
        if layer.amx is not None and self.AMX_MIN_ROWS <= rows <= self.AMX_PREFILL_MAX_ROWS:
            out = cpu_linear.amx_linear(layer.amx, x, layer.weight)
        elif layer.kernel is not None and rows <= layer.small_rows:
            out = cpu_linear.small_batch_linear(layer.kernel, x, layer.weight)
        else:
            return F.linear(x, layer.weight, layer.bias)
        return out if layer.bias is None else out + layer.bias


class VnniLinearMethod(SmallBatchLinearMethod):
    """bf16 on CPUs with AVX512-BF16: every matmul in C kernels (kernels/vnni_linear.c), on the weight
    reordered once, in place, into the order AMX reads it (blocks of 16 outputs, input pairs side by side).

    Without AMX (AMD's Zen 4), three rows and more run AVX512-BF16 register tiles on the same layout:
    over the 0.6B model's matmuls on one CPU, in turns with oneDNN on the plain weight, 0.55x its time
    at 8 rows, 0.74x at 32, 0.91x at 128 and 0.96x at 512, what oneDNN takes on its own reordered copy
    (bench/bench_prefill_matmul.py). One row streams the reordered weight as the plain one's kernel does.
    The figures that follow are a CPU with AMX's.

    On the plain weight, the AMX kernel loads 16-row tiles from lines kilobytes apart, copies each block
    and transposes its results at every call; on the reordered one a tile is one contiguous kilobyte.
    Measured on the 0.6B model's matmuls, layer by layer in turns (bench/bench_prefill_matmul.py): the
    same bits in 0.59x oneDNN's time at 64 rows (plain: 0.67x), 0.68x at 128 (0.82x), 0.76x at 256
    (0.90x); above 256 rows, where F.linear ran before, 0.93x at 512 and 0.94x at 768, about what
    oneDNN takes on its own reordered copy (0.94x, 0.95x). One or two rows stream the reordered weight
    at 1.00x and 0.90x the small-batch kernel's time on the plain one. So no plain copy is kept: the
    reorder is in place and no memory is added. A layer the kernel does not take (outputs not a
    multiple of 32) stays plain on SmallBatchLinearMethod's kernels. The vocab projection is reordered
    too; a tied embedding then looks its rows up in the same storage, in VNNI order
    (VocabParallelEmbedding.share_with_head). The MLP's gate/up layer also has the fused pass with its
    activation (apply_silu_and_mul).
    """

    name = "amx-vnni"

    def __init__(self, library, amx, vnni):
        super().__init__(library, amx)
        self.vnni = vnni

    def process_weights_after_loading(self, layer):
        super().process_weights_after_loading(layer)
        layer.vnni = self.vnni if layer.kernel is not None and cpu_linear.vnni_supports(layer.weight) else None
        if layer.vnni is not None:
            # A parameter over the same storage: the loader's huge pages keep holding it.
            layer.vnni_weight = nn.Parameter(cpu_linear.vnni_pack_(layer.vnni, layer.weight.data), requires_grad=False)
            layer.weight = None

    def apply(self, layer, x):
        if layer.vnni is None:
            return super().apply(layer, x)
        out = cpu_linear.vnni_linear(layer.vnni, x, layer.vnni_weight)
        return out if layer.bias is None else out + layer.bias

    def apply_silu_and_mul(self, layer, x):
        # The activation on the result tiles, beside the tile products: the (rows, 2 x intermediate)
        # product is never written and read back, and no pass of its own runs. Measured over the 0.6B
        # model's 28 gate/up weights (bench/bench_swiglu.py): 0.86-0.95x the time of the matmul and
        # silu_and_mul apart, from 32 to 768 rows.
        if layer.vnni is None or layer.bias is not None:
            return None
        return cpu_linear.vnni_linear_silu(layer.vnni, x, layer.vnni_weight)



class LinearBase(nn.Module):
    """y = x W^T + b over this rank's slice; the method decides how W is held and multiplied."""

    def __init__(self, in_features: int, out_features: int, bias: bool, method: LinearMethod | None,
                 tp: TensorParallel | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # this rank's shape
        self.tp = tp or TensorParallel()
        self.method = method or PlainLinearMethod()
        self.method.create_weights(self, in_features, out_features, bias)

    # LoRA adapter slots (model/lora/slots.py) where adapters are enabled and this layer is a target; None: none.
    lora = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_lora(x, self.method.apply(self, x))

    def add_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y with the step's adapter rows' LoRA products added; y itself in a step without adapter rows."""
        return y if self.lora is None else self.lora.add(y, x)

    def weight_loader(self, leaf: str, source: CheckpointTensor, shard=None) -> None:
        """Fill parameter `leaf` (weight or bias) from a checkpoint tensor; raises WeightShapeError."""
        param = getattr(self, leaf)
        source = self.method.checkpoint_tensor(self, leaf, source, param.shape[0])
        param.data.copy_(read_whole(source, param.data))

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, method={self.method.name}")


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, method: LinearMethod | None = None):
        super().__init__(in_features, out_features, bias, method, None)


class ColumnParallelLinear(LinearBase):
    """Each rank computes a slice of the outputs: the weight (and bias) split along dim 0."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, method: LinearMethod | None = None,
                 tp: TensorParallel | None = None):
        tp = tp or TensorParallel()
        super().__init__(in_features, out_features // tp.size, bias, method, tp)

    def shard_slice(self, shard) -> slice:
        """Where a fused weight's part goes in this rank's outputs; one part by default."""
        return slice(0, self.out_features)

    def weight_loader(self, leaf, source, shard=None):
        param = getattr(self, leaf).data
        dest = param if shard is None else param[self.shard_slice(shard)]
        source = self.method.checkpoint_tensor(self, leaf, source, dest.shape[0] * self.tp.size)
        dest.copy_(split_rows(source, dest, 0, self.tp))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate and up); shard i is the i-th."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 method: LinearMethod | None = None, tp: TensorParallel | None = None):
        tp = tp or TensorParallel()
        self.local_sizes = [size // tp.size for size in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias, method, tp)

    def shard_slice(self, shard: int) -> slice:
        start = sum(self.local_sizes[:shard])
        return slice(start, start + self.local_sizes[shard])

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """F.silu(gate) * up of shards (gate, up) in one pass where the method has one; None: call the
        layer and apply the activation."""
        if len(self.local_sizes) != 2 or self.local_sizes[0] != self.local_sizes[1]:
            return None
        if self.lora is not None and self.lora.state.batch is not None:
            return None  # the adapter rows' products go in before the activation
        return self.method.apply_silu_and_mul(self, x)


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections in one matmul; each rank holds its heads of all three."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 method: LinearMethod | None = None, tp: TensorParallel | None = None):
        tp = tp or TensorParallel()
        self.q_size = num_heads // tp.size * head_dim
        self.kv_size = num_kv_heads // tp.size * head_dim
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, method, tp)

    def shard_slice(self, shard: str) -> slice:
        start = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[shard]
        return slice(start, start + (self.q_size if shard == "q" else self.kv_size))


class RowParallelLinear(LinearBase):
    """Each rank sums part of the inputs: the weight split along dim 1, the partial outputs all-reduced.

    The bias is whole and added by rank 0 alone (the others hold zeros), so it counts once in the sum.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, method: LinearMethod | None = None,
                 tp: TensorParallel | None = None):
        tp = tp or TensorParallel()
        super().__init__(in_features // tp.size, out_features, bias, method, tp)

    def weight_loader(self, leaf, source, shard=None):
        param = getattr(self, leaf).data
        if leaf == "bias":
            loaded = read_whole(source, param)
            param.copy_(loaded if self.tp.rank == 0 else torch.zeros_like(param))
        else:
            source = self.method.checkpoint_tensor(self, leaf, source, param.shape[0])
            param.copy_(split_rows(source, param, 1, self.tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.add_lora(x, self.method.apply(self, x)))


def linear_layers(model: nn.Module, include_lm_head: bool = True) -> list[tuple[str, LinearBase]]:
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, LinearBase) and (include_lm_head or not name.endswith("lm_head"))]


def use_linear_method(model: nn.Module, method: LinearMethod, include_lm_head: bool = True) -> int:
    """Hand the model's loaded linear layers to `method`; returns how many.

    For layers whose weights are in the plain form (what PlainLinearMethod loads), so a model
    loaded plain, e.g. as a reference in tests, can be switched afterwards.
    """
    layers = linear_layers(model, include_lm_head)
    for _, layer in layers:
        if type(layer.method) is not PlainLinearMethod:
            raise ValueError(f"{layer.method.name} weights cannot change method")
        layer.method = method
        method.process_weights_after_loading(layer)
    return len(layers)


def use_head_method(head: LinearBase, method: LinearMethod) -> None:
    """Give a layer not yet loaded (built on the meta device) another method: the vocab projection kept
    in bf16 while the decoder's layers are 8-bit, or the reverse. A tied head is re-tied after loading."""
    head.method = method
    head._parameters.clear()  # the other method's parameters (8-bit scales, say) are not this one's
    method.create_weights(head, head.in_features, head.out_features, head.bias is not None)


def cpu_linear_method(device: torch.device, dtype: torch.dtype, small_batch_kernel: bool | None,
                      pack_weights: bool | None, vnni_weights: bool | None = None) -> LinearMethod:
    """The fastest exact method for this device and dtype, as the engine's flags allow.

    small_batch_kernel None: the C kernels where they build (bf16, a CPU with AVX512-BF16 and a C
    compiler); True: required. vnni_weights None: with those, the weights reordered into VNNI order
    (VnniLinearMethod: AMX tiles where the CPU has them, else AVX512-BF16); True: required; False: plain. pack_weights None: oneDNN packing on CPU
    where the kernels are not used.
    """
    on_cpu = device.type == "cpu"
    if small_batch_kernel is not False and on_cpu and dtype == torch.bfloat16:
        library = cpu_linear.load()
        if library is not None:
            amx = cpu_linear.load_amx()
            vnni = cpu_linear.load_vnni() if vnni_weights is not False else None
            if vnni is not None:
                return VnniLinearMethod(library, amx, vnni)
            if vnni_weights:
                raise ValueError("vnni_weights needs a C compiler and a CPU with AVX512-BF16")
            return SmallBatchLinearMethod(library, amx)
        if small_batch_kernel:
            raise ValueError("small_batch_kernel needs a C compiler and a CPU with AVX512-BF16")
    if vnni_weights:
        raise ValueError("vnni_weights needs bf16 on a CPU with AVX512-BF16, the small-batch kernels and a C compiler")
    pack = pack_weights if pack_weights is not None else on_cpu
    if pack and packing_supported(device, dtype):
        return PackedLinearMethod()
    return PlainLinearMethod()
