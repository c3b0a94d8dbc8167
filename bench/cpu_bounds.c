/* What one core can do at most, for bench_cpu_bounds.py: stream bytes from memory, and multiply bf16 pairs.
 *
 * read_sum streams a buffer once with 512-bit loads (eight independent sums, so no add waits on another) and
 * returns a checksum the compiler cannot drop. bf16_dot_peak runs vdpbf16ps on twelve independent accumulators
 * in registers, nothing loaded: the most bf16 multiply-adds the core issues. Both are bounds no kernel beats;
 * a decode step that reads its weights, or a prefill's matmuls, can be held against them.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

int64_t read_sum(const uint8_t *p, int64_t bytes) {
    __m512i s[8];
    for (int i = 0; i < 8; i++) s[i] = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 512 <= bytes; i += 512)
        for (int j = 0; j < 8; j++) s[j] = _mm512_add_epi64(s[j], _mm512_loadu_si512(p + i + 64 * j));
    for (int j = 1; j < 8; j++) s[0] = _mm512_add_epi64(s[0], s[j]);
    int64_t total = _mm512_reduce_add_epi64(s[0]);
    for (; i < bytes; i++) total += p[i];
    return total;
}
#else
int64_t read_sum(const uint8_t *p, int64_t bytes) {
    int64_t total = 0;
    for (int64_t i = 0; i < bytes; i++) total += p[i];
    return total;
}
#endif

#if defined(__AVX512BF16__)
/* FLOPs done: iterations * 12 accumulators * 16 lanes * 2 pairs * 2 (a multiply and an add). Twelve named
 * accumulators, not an array, so that every one stays in a register. Each starts from its own value: started
 * alike, the twelve hold the same values throughout, and the compiler keeps one of them, one chain of
 * dependent products (which read as twice the peak on AMD's Zen 4, whose products take six cycles). */
float bf16_dot_peak(int64_t iterations) {
    __m512 a0 = _mm512_set1_ps(0.0f), a1 = _mm512_set1_ps(1.0f), a2 = _mm512_set1_ps(2.0f),
           a3 = _mm512_set1_ps(3.0f), a4 = _mm512_set1_ps(4.0f), a5 = _mm512_set1_ps(5.0f),
           a6 = _mm512_set1_ps(6.0f), a7 = _mm512_set1_ps(7.0f), a8 = _mm512_set1_ps(8.0f),
           a9 = _mm512_set1_ps(9.0f), a10 = _mm512_set1_ps(10.0f), a11 = _mm512_set1_ps(11.0f);
    const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3c00);
    for (int64_t n = 0; n < iterations; n++) {
        a0 = _mm512_dpbf16_ps(a0, x, y), a1 = _mm512_dpbf16_ps(a1, x, y), a2 = _mm512_dpbf16_ps(a2, x, y);
        a3 = _mm512_dpbf16_ps(a3, x, y), a4 = _mm512_dpbf16_ps(a4, x, y), a5 = _mm512_dpbf16_ps(a5, x, y);
        a6 = _mm512_dpbf16_ps(a6, x, y), a7 = _mm512_dpbf16_ps(a7, x, y), a8 = _mm512_dpbf16_ps(a8, x, y);
        a9 = _mm512_dpbf16_ps(a9, x, y), a10 = _mm512_dpbf16_ps(a10, x, y), a11 = _mm512_dpbf16_ps(a11, x, y);
    }
    const __m512 total = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                       _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)),
                                                     _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11))));
    return _mm512_reduce_add_ps(total);
}
#else
float bf16_dot_peak(int64_t iterations) {
    (void)iterations;
    return -1.0f;
}
#endif

int has_bf16_dot(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
