"""The linear layers' weight formats for a device and the engine's flags: one for the decoder layers, one for the head."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.model_worker.config.quantization import QuantScheme, checkpoint_quantization, resolve_scheme
from services.model_worker.kernels import cpu_q8_linear
from services.model_worker.model.layers.linear import LinearMethod, cpu_linear_method
from services.model_worker.model.layers.quant.eight_bit import EightBitLinearMethod

log = logging.getLogger(__name__)


@dataclass
class LinearMethods:
    body: LinearMethod  # every linear layer of the decoder
    head: LinearMethod  # the vocab projection: bf16 unless the head is quantized too

    @property
    def name(self) -> str:
        return self.body.name if self.head is self.body else f"{self.body.name} (head: {self.head.name})"


def linear_methods(device: torch.device, dtype: torch.dtype, quantization_config: dict | None, quantization: str,
                   quantize_lm_head: bool, small_batch_kernel: bool | None = None,
                   pack_weights: bool | None = None, int8_activations: bool = True,
                   vnni_weights: bool | None = None) -> LinearMethods:
    """The checkpoint's quantization_config (fp8 blocks) or --quantization decide the format of the decoder's
    layers; the head keeps the exact method of the device (cpu_linear_method, its head_method) unless
    --quantize-lm-head.
    int8_activations: int8 weights multiply activations quantized to int8 on CPU (--int8-activations)."""
    scheme: QuantScheme | None = resolve_scheme(checkpoint_quantization(quantization_config), quantization,
                                                quantize_lm_head)
    exact = cpu_linear_method(device, dtype, small_batch_kernel, pack_weights, vnni_weights)
    if scheme is None:
        return LinearMethods(exact, exact.head_method())
    kernels = cpu_q8_linear.load() if device.type == "cpu" else None
    if device.type == "cpu" and dtype == torch.bfloat16 and kernels is None:
        log.warning("8-bit weights without the C kernels (no AVX-512 or no C compiler): every matmul dequantizes "
                    "its layer first, slower than bf16 weights")
    triton = device.type == "cuda"
    body = EightBitLinearMethod(scheme.method, scheme.from_checkpoint, kernels, triton, int8_activations)
    head = EightBitLinearMethod(scheme.method, False, kernels, triton, int8_activations) if scheme.lm_head \
        else exact.head_method()
    return LinearMethods(body, head)
