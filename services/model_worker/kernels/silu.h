/* SiLU and its product with the up projection, rounded as torch rounds F.silu(gate) * up in bf16:
 * shared by decoder.c's silu_and_mul and vnni_linear.c's fused gate/up epilogue, so both give the
 * same bits. */
#ifndef VLLM_V0_SILU_H
#define VLLM_V0_SILU_H

#ifdef __AVX512F__
#include <immintrin.h>

#include "bf16.h"

/* Sleef's expf, u10 variant, operation for operation (fused multiply-adds where Sleef's AVX-512
 * build has them): what torch's Vectorized<float>::exp returns, so SiLU rounds as torch's does. */
static inline __m512 sleef_expf16(__m512 d) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, _mm512_set1_ps(1.442695040888963407359924681001892137f)));
    const __m512 qf = _mm512_cvtepi32_ps(q);
    __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
    s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    /* u * 2^q in two steps, as Sleef's ldexp2 does. */
    const __m512i half = _mm512_srai_epi32(q, 1), bias = _mm512_set1_epi32(0x7f);
    u = _mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(half, bias), 23)));
    u = _mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(q, half), bias), 23)));
    u = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_LT_OQ), u, _mm512_setzero_ps());
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(_mm512_set1_ps(100.0f), d, _CMP_LT_OQ), u,
                                _mm512_set1_ps(__builtin_inff()));
}

/* bf16(bf16(silu(g)) * u) for sixteen gate and up values already rounded to bf16 (held as float32):
 * SiLU is x / (1 + exp(-x)) in float32, as torch computes it. Returns round_bf16x16's lanes. */
static inline __m512i silu_and_mul16(__m512 g, __m512 u) {
    const __m512 e = sleef_expf16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 silu = _mm512_castsi512_ps(round_bf16x16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e))));
    return round_bf16x16(_mm512_mul_ps(silu, u));
}

/* act[0..n) = F.silu(gate) * up for one row gate_up = [gate | up] (bf16, n a multiple of 16). */
static inline void silu_and_mul_row(const uint16_t *gate_up, uint16_t *act, int64_t n) {
    for (int64_t i = 0; i < n; i += 16)
        store_bf16(act + i, silu_and_mul16(load_bf16(gate_up + i), load_bf16(gate_up + n + i)));
}
#endif

#endif
