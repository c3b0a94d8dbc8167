/* A 16 x 16 transpose of 32-bit lanes in AVX-512 registers, for the CPU kernels. */
#ifndef VLLM_V0_TRANSPOSE_H
#define VLLM_V0_TRANSPOSE_H

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 vectors of 16 32-bit lanes, transposed in place: lane j of v[i] goes to lane i of v[j]. */
static inline void transpose16(__m512i v[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* Now 128-bit lane L of v[i + x] holds column 4 L + x of rows i to i + 3 (i a multiple of 4);
     * the shuffles gather each column's four lanes from the four groups of rows. */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(v[i], v[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(v[i + 8], v[i + 12], 0xDD);
    }
    for (int i = 0; i < 4; i++) {
        v[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        v[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
        v[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        v[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
    }
}
#endif

#endif
