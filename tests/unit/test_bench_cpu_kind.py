"""The CPU kind a benchmark files its figures under, from /proc/cpuinfo's flags."""

from bench.cpu_kind import cpu_description, cpu_kind, cpu_model


def test_kinds_from_flags():
    xeon = "fpu sse avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8".split()
    zen4 = "fpu sse avx2 avx512f avx512bw avx512_bf16 avx512_vnni".split()
    assert cpu_kind(xeon) == "AMX"
    assert cpu_kind(zen4) == "AVX512"
    assert cpu_kind("fpu sse avx2 fma".split()) == "x86"


def test_this_machine_is_named():
    assert cpu_kind() in ("AMX", "AVX512", "x86")
    assert cpu_model() and cpu_model() in cpu_description()
