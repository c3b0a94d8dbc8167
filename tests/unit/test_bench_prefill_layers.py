"""bench_prefill_layers' two halves: vLLM's profiled ops sorted into components, and the timing stand-ins of
our fused prefill's kernels (bench/prefill_timers.c), which must pass every call through unchanged."""
import ctypes

import pytest
import torch

from bench.prefill_profile_ours import FIXED, SHAPES, TIMERS
from bench.prefill_profile_vllm import component, vllm_components
from services.model_worker.kernels import build, cpu_linear, cpu_norm


def test_vllm_ops_fall_into_the_components_by_name_and_shape():
    assert component('_C::onednn_mm [[128, 4096], [128, 1024], []]') == "qkv"
    assert component('_C::onednn_mm [[512, 1024], [512, 3072], []]') == "down"
    assert component('_C::onednn_mm [[1, 151936], [1, 1024], []]') == "rest"
    assert component("_C::cpu_attention_with_kv_cache") == "attention"
    assert component("_C::cpu_attn_reshape_and_cache") == "kv_write"
    assert component("graph_0_cpp_fused__to_copy_add_mean_mul_onednn_mm_pow_rsqrt_7") == "norms"
    assert component("graph_0_cpp_fused__to_copy_add_index_select_mean_mul_pow_rsqrt_split_1") == "qk_norm_rotary"
    assert component("graph_0_cpp_fused_mul_onednn_mm_silu_slice_3") == "gate_up"
    assert component("aten::slice") is None


def test_vllm_rest_is_the_first_token_less_every_named_component():
    answer = {"ttft_ms": 100.0, "ranges": {"forward": 90.0, "lm_head": 5.0, "sampling": 1.0},
              "ops": {'_C::onednn_mm [[128, 6144], [128, 1024], []]': [60.0, 28], "aten::view": [2.0, 56],
                      "_C::cpu_attention_with_kv_cache": [10.0, 28]}}
    parts = vllm_components(answer)
    assert parts["gate_up"] == 60.0 and parts["attention"] == 10.0 and parts["lm_head"] == 5.0
    assert parts["rest"] == pytest.approx(100.0 - 60.0 - 10.0 - 5.0 - 1.0)


@pytest.mark.skipif("avx512_bf16" not in build.cpu_features(), reason="the CPU has no AVX512-BF16")
def test_timing_stand_ins_pass_calls_through_and_count_them_by_shape():
    timers, vnni, norm = build.load(TIMERS, "prefill timers"), cpu_linear.load_vnni(), cpu_norm.load()
    address = lambda lib, name: ctypes.cast(getattr(lib, name), ctypes.c_void_p).value  # noqa: E731
    timers.timers_set(*(ctypes.c_void_p(a) for a in (address(vnni, "vnni_linear"), address(vnni, "vnni_linear_silu"),
                                                      address(norm, "rms_norm"), address(norm, "rms_norm_rope"),
                                                      None, None)))
    counters, shapes = (ctypes.c_double * (len(FIXED) + SHAPES))(), (ctypes.c_int64 * (3 * SHAPES))()
    timers.timers_take(counters, shapes)
    x, w = torch.randn(8, 64).bfloat16(), torch.randn(96, 64).bfloat16()
    packed = cpu_linear.vnni_pack_(vnni, w.clone())
    out = torch.empty(8, 96, dtype=torch.bfloat16)
    timed = ctypes.cast(timers.timed_linear, ctypes.c_void_p).value
    call = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                            ctypes.c_int64, ctypes.c_int64)(timed)
    assert call(x.data_ptr(), packed.data_ptr(), out.data_ptr(), 8, 96, 64) == 0
    assert torch.equal(out, cpu_linear.vnni_linear(vnni, x, packed))
    seen = timers.timers_take(counters, shapes)
    assert seen == 1 and list(shapes[:3]) == [96, 64, 0] and counters[len(FIXED)] > 0
    assert timers.timers_take(counters, shapes) == 0 and counters[len(FIXED)] == 0  # taken means zeroed
