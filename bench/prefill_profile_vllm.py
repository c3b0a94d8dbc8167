"""vLLM's side of bench_prefill_layers.py on our side of the pipe: its profiled op table sorted into the same
components as ours."""
from __future__ import annotations

import json

# Qwen3-0.6B's matmuls by (output width, input width), as oneDNN's calls record their shapes.
MATMULS = {(4096, 1024): "qkv", (1024, 2048): "o", (6144, 1024): "gate_up", (1024, 3072): "down"}


def _kernel(name: str) -> str:
    """The component of one of inductor's fused C++ kernels, by the ops its name lists."""
    if "rsqrt" in name and "index_select" in name:
        return "qk_norm_rotary"  # the q/k norms, the cos/sin lookup and the rotation in one kernel
    if "rsqrt" in name:
        return "norms"  # its residual adds are fused into the norms' kernels
    if "silu" in name:
        return "gate_up"  # the SiLU-and-product, which ours does inside the gate/up matmul
    if "index_select" in name or "cos" in name or "sin" in name:
        return "rotary_tables"
    if "embedding" in name:
        return "embedding"
    return "residual_copies"


def component(op: str) -> str | None:
    """The component an op's self time counts towards, None for the rest."""
    name, _, shapes = op.partition(" ")
    if name.endswith("onednn_mm") and shapes:
        out, x = json.loads(shapes)[:2]
        return MATMULS.get((out[-1], x[-1]), "rest")
    if "cpu_attention_with_kv_cache" in name or "unified_attention" in name:
        return "attention"
    if "reshape_and_cache" in name or "kv_cache_update" in name:
        return "kv_write"
    if name.startswith("graph_") and "cpp_fused" in name:
        return _kernel(name)
    if name in ("aten::embedding", "aten::index_select"):
        return "embedding"
    return None


def vllm_components(answer: dict) -> dict:
    """The driver's profiled answer as {component: ms}, with the same keys as ours."""
    out = dict.fromkeys(("qkv", "o", "gate_up", "down", "attention", "norms", "qk_norm_rotary", "rotary_tables",
                         "kv_write", "residual_copies", "embedding"), 0.0)
    for op, (ms, _calls) in answer["ops"].items():
        key = component(op)
        if key is not None:
            out[key] += ms
    ranges = answer["ranges"]
    out.update(total=answer["ttft_ms"], lm_head=ranges["lm_head"], sampling=ranges["sampling"], schedule_inputs=0.0)
    out["rest"] = answer["ttft_ms"] - sum(v for k, v in out.items() if k != "total")
    return out
