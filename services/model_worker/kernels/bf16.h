/* bf16 <-> float32 for the CPU kernels: bf16 is the top half of a float32. */
#ifndef VLLM_V0_BF16_H
#define VLLM_V0_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Round to nearest even, as torch does; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#ifdef __AVX512F__
#include <immintrin.h>

/* Sixteen f32_to_bf16 at once: each lane's bf16 bits in its high half, the low half zero (so the
 * lane, read as float32, is the rounded value). */
static inline __m512i round_bf16x16(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    const __m512i nan = _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000));
    const __m512i kept = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), rounded, nan);
    return _mm512_and_si512(kept, _mm512_set1_epi32((int)0xFFFF0000u));
}

/* Sixteen bf16 values as float32 (exact). */
static inline __m512 load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline void store_bf16(uint16_t *p, __m512i rounded) { /* rounded: from round_bf16x16 */
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
#endif

#endif
