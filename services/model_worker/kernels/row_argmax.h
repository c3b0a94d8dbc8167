/* The first index of a row's largest value, a NaN counting as largest (the first NaN wins), as torch.argmax
 * answers; rows of bf16 or float32. Shared by the greedy argmax (argmax.c) and the sampler's race
 * (random_draws.c). */
#ifndef ROW_ARGMAX_H
#define ROW_ARGMAX_H

#include <stdint.h>
#include <string.h>

#include "bf16.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline float value(const void *row, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

#ifdef __AVX512F__
static inline __m512 load16(const void *row, int64_t i, int is_bf16) {
    if (is_bf16) {
        const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
    return _mm512_loadu_ps((const float *)row + i);
}
#endif

/* The row's largest value, or a NaN if it has one (*has_nan set). */
static float row_max(const void *row, int64_t n, int is_bf16, int *has_nan) {
    float best = value(row, 0, is_bf16);
    int64_t i = 0;
#ifdef __AVX512F__
    if (n >= 16) {
        __m512 m = load16(row, 0, is_bf16);
        __mmask16 nan = 0;
        for (i = 0; i + 16 <= n; i += 16) {
            const __m512 v = load16(row, i, is_bf16);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            m = _mm512_max_ps(m, v);
        }
        if (nan) {
            *has_nan = 1;
            return __builtin_nanf("");
        }
        best = _mm512_reduce_max_ps(m);
    }
#endif
    for (; i < n; i++) {
        const float v = value(row, i, is_bf16);
        if (v != v) {
            *has_nan = 1;
            return v;
        }
        if (v > best) best = v;
    }
    return best;
}

static int64_t row_argmax(const void *row, int64_t n, int is_bf16) {
    int has_nan = 0;
    const float best = row_max(row, n, is_bf16, &has_nan);
    int64_t start = 0;
#ifdef __AVX512F__
    /* The first match, sixteen values a compare: scanned one at a time, this pass took longer
     * than the max (about half a row on average). */
    const __m512 target = _mm512_set1_ps(best);
    for (; start + 16 <= n; start += 16) {
        const __m512 v = load16(row, start, is_bf16);
        const __mmask16 hit = has_nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
        if (hit) return start + __builtin_ctz(hit);
    }
#endif
    for (int64_t i = start; i < n; i++) {
        const float v = value(row, i, is_bf16);
        if (has_nan ? v != v : v == best) return i;
    }
    return 0;  /* not reached: the maximum is one of the row's values */
}

#endif
