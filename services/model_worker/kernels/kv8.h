/* The 8-bit KV cache formats' arithmetic for the CPU kernels (model/layers/attention/kv_quant.py is the
 * torch reference, docs/kv-cache.md the description).
 *
 * fp8: e4m3fn with one scale per layer: q = e4m3(clamp(x / scale, -448, 448)), rounded to nearest even
 * as torch converts. int8: one scale per row (a KV head's head_dim values of one token): s = max|x| / 127,
 * q = round(x / s) to nearest even, by division as torch divides; a row of zeros has s = 0 and q = 0.
 * Both read back as float32(q) * scale.
 */
#ifndef VLLM_V0_KV8_H
#define VLLM_V0_KV8_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "widen8.h" /* widen8x16: 16 cache bytes as float32 */

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define KV_SAME 0 /* the cache holds the query's dtype */
#define KV_FP8 1
#define KV_INT8 2
#define FP8_MAX 448.0f

/* float32 to e4m3fn bits, round to nearest even: c10's fp8e4m3fn_from_fp32_value, which torch's .to() runs.
 * Past 480 (and NaN) gives the NaN byte 0x7f; callers clamp to 448 first. */
static inline uint8_t f32_to_e4m3(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t result;
    if (bits >= (1087u << 20)) {
        result = 0x7f;
    } else if (bits < (121u << 23)) { /* below 2^-6: subnormal, rounded by a float addition */
        const uint32_t denorm_mask = 141u << 23;
        float g, m;
        memcpy(&g, &bits, 4);
        memcpy(&m, &denorm_mask, 4);
        g += m;
        memcpy(&bits, &g, 4);
        result = (uint8_t)(bits - denorm_mask);
    } else {
        const uint32_t mant_odd = (bits >> 20) & 1;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFF + mant_odd;
        result = (uint8_t)(bits >> 20);
    }
    return result | (uint8_t)(sign >> 24);
}

/* e4m3fn bits to float32, exactly (NaN bytes as NaN). */
static inline float e4m3_to_f32(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float x;
    if ((b & 0x7f) == 0x7f) x = NAN;
    else if (e == 0) x = ldexpf((float)m, -9);
    else x = ldexpf((float)(8 + m), e - 10);
    return b & 0x80 ? -x : x;
}

/* One cache row of n values (float32 in x) quantized into q; returns the row's int8 scale (fp8: scale). */
static inline float quantize_row(const float *x, uint8_t *q, int n, int kind, float scale) {
    int i = 0;
    if (kind == KV_FP8) {
#ifdef __AVX512F__
        const __m512 s = _mm512_set1_ps(scale), hi = _mm512_set1_ps(FP8_MAX), lo = _mm512_set1_ps(-FP8_MAX);
        for (; i + 16 <= n; i += 16) {
            /* f32_to_e4m3 on 16 lanes: min/max keep a NaN quotient NaN as clamp does (it becomes 0x7f). */
            const __m512 y = _mm512_div_ps(_mm512_loadu_ps(x + i), s);
            const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
            const __m512 c = _mm512_mask_mov_ps(_mm512_max_ps(_mm512_min_ps(y, hi), lo), nan, y);
            const __m512i bits = _mm512_castps_si512(c);
            const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32((int)0x80000000u));
            const __m512i abs = _mm512_xor_si512(bits, sign);
            const __m512i denorm_mask = _mm512_set1_epi32((int)(141u << 23));
            const __m512i sub = _mm512_sub_epi32(
                _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(abs), _mm512_castsi512_ps(denorm_mask))),
                denorm_mask);
            const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(abs, 20), _mm512_set1_epi32(1));
            const __m512i normal = _mm512_srli_epi32(
                _mm512_add_epi32(_mm512_add_epi32(abs, _mm512_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFF))),
                                 odd), 20);
            __m512i r = _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(abs, _mm512_set1_epi32((int)(121u << 23))),
                                                normal, sub);
            r = _mm512_mask_blend_epi32(_mm512_cmpge_epu32_mask(abs, _mm512_set1_epi32((int)(1087u << 20))), r,
                                        _mm512_set1_epi32(0x7f));
            r = _mm512_or_si512(_mm512_and_si512(r, _mm512_set1_epi32(0xff)), _mm512_srli_epi32(sign, 24));
            _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(r));
        }
#endif
        for (; i < n; i++) {
            const float y = x[i] / scale;
            q[i] = f32_to_e4m3(isnan(y) ? y : fminf(fmaxf(y, -FP8_MAX), FP8_MAX));
        }
        return scale;
    }
    float amax = 0.0f;
    for (int j = 0; j < n; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float s = amax / 127.0f, d = s == 0.0f ? 1.0f : s;
#ifdef __AVX512F__
    const __m512 dv = _mm512_set1_ps(d);
    for (; i + 16 <= n; i += 16) {
        const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), dv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
    }
#endif
    for (; i < n; i++) q[i] = (uint8_t)(int8_t)nearbyintf(x[i] / d);
    return s;
}

/* One cache value as widen8x16 gives it (fp8: 2^-8 times its value). */
static inline float widen8(const uint8_t *p, int i, int fp8) {
    return fp8 ? e4m3_to_f32(p[i]) * 0.00390625f : (float)(int8_t)p[i];
}

#endif
