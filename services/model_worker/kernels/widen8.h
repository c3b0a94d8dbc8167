/* 16 bytes of int8 or fp8 e4m3 widened to float32 in registers: the one widening the 8-bit weight kernels
 * (q8_linear.c) and the 8-bit KV cache kernels (kv8.h, paged_attention.c) share. */
#ifndef VLLM_V0_WIDEN8_H
#define VLLM_V0_WIDEN8_H

#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 values as float32: int8 exactly; fp8 e4m3 as 2^-8 times its value. An e4m3 byte s.eeee.mmm
 * sign-extended to 16 bits and shifted left 7 puts eeee.mmm where a float16 keeps the low four
 * exponent bits and top three mantissa bits, and s in the sign; the mask clears the copy of s
 * that lands in the exponent's top bit. float16's exponent bias is 8 more than e4m3's, for normal
 * and subnormal numbers alike. (e4m3fn's NaN bytes become finite numbers.) */
static inline __attribute__((always_inline)) __m512 widen8x16(const uint8_t *p, const int fp8) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    if (fp8) {
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                           _mm256_set1_epi16((short)0xBF80));
        return _mm512_cvtph_ps(h);
    }
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
#endif

#endif
