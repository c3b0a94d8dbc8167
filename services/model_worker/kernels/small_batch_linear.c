/* y = x W^T for a few rows of x, bf16 weights read straight from memory: the decode-step matmul.
 *
 * A decode step of one to a few sequences multiplies a handful of activation rows by every weight
 * once: the work is reading the weights, and oneDNN's GEMM reads them at about half the speed the
 * memory can stream. Here each thread walks its own stretch of output rows (for one input row: on
 * Xeons with AMX several weight rows in flight, elsewhere one after another), with prefetch ahead, and
 * AVX512-BF16 dot products (vdpbf16ps) accumulate in float32;
 * the result is rounded to bf16 once, to nearest even, as torch rounds. Larger batches are
 * compute-bound and stay with oneDNN (AMX where the CPU has it).
 *
 * Built only where the compiler targets AVX512-BF16; elsewhere small_batch_linear returns -1
 * and the caller keeps to torch.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define ROWS 8     /* weight rows in flight for one input row */
#define M_BLOCK 4  /* input rows sharing each weight load when there are several */

#if defined(__AMX_TILE__)
/* One input row on Xeons with AMX: ROWS output rows at a time, each weight row prefetched a block ahead
 * (the same place in the row ROWS rows on: measured against two blocks ahead, the 0.6B model's weights
 * streamed in 40.5-48.8 ms against 41.1-50.6 ms, faster in each of six alternating pairs). */
static void one_row(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t n, int64_t k) {
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < n; n0 += ROWS) {
        const int rows = n - n0 < ROWS ? (int)(n - n0) : ROWS;
        __m512 acc[ROWS];
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t j = 0; j < k; j += 32) {
            const __m512i xv = _mm512_loadu_si512(x + j);
            for (int r = 0; r < rows; r++) {
                const uint16_t *p = w + (n0 + r) * k + j;
                _mm_prefetch((const char *)(p + ROWS * k), _MM_HINT_T0);
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(p), (__m512bh)xv);
            }
        }
        for (int r = 0; r < rows; r++) out[n0 + r] = f32_to_bf16(_mm512_reduce_add_ps(acc[r]));
    }
}
#else
/* One input row elsewhere (AMD's Zen 4): the weight rows one after another, so each thread reads one
 * run of consecutive lines, prefetched 4 KB ahead. Each output sums the same products in the same
 * order as above (the same bits). The vocabulary projection's 151,936 x 1,024 weight on one core: the
 * fastest of seven passes took 11.6-13.1 ms (24-27 GB/s) against 24.6 ms with 8 rows interleaved, and
 * 25-33 ms with 2 or 4 rows interleaved. */
static void one_row(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t n, int64_t k) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = w + r * k;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < k; j += 32) {
            _mm_prefetch((const char *)(row + j) + 4096, _MM_HINT_T0);
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(row + j), (__m512bh)_mm512_loadu_si512(x + j));
        }
        out[r] = f32_to_bf16(_mm512_reduce_add_ps(acc));
    }
}
#endif

#if defined(__AMX_TILE__)
/* Several input rows on Xeons with AMX: 4 weight rows by M_BLOCK input rows of accumulators, each weight
 * row prefetched one block (4 rows) ahead: at two rows, 58.8-62.4 ms for the 0.6B model's weights
 * against 60.9-66.1 ms two blocks ahead, in three alternating pairs. */
static void few_rows(const uint16_t *x, const uint16_t *w, uint16_t *out, int m, int64_t n, int64_t k) {
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < n; n0 += 4) {
        const int rows = n - n0 < 4 ? (int)(n - n0) : 4;
        for (int m0 = 0; m0 < m; m0 += M_BLOCK) {
            const int ms = m - m0 < M_BLOCK ? m - m0 : M_BLOCK;
            __m512 acc[4][M_BLOCK];
            for (int r = 0; r < 4; r++)
                for (int i = 0; i < M_BLOCK; i++) acc[r][i] = _mm512_setzero_ps();
            for (int64_t j = 0; j < k; j += 32) {
                __m512i xv[M_BLOCK];
                for (int i = 0; i < ms; i++) xv[i] = _mm512_loadu_si512(x + (m0 + i) * k + j);
                for (int r = 0; r < rows; r++) {
                    const uint16_t *p = w + (n0 + r) * k + j;
                    if (m0 == 0) _mm_prefetch((const char *)(p + 4 * k), _MM_HINT_T0);
                    const __m512i wv = _mm512_loadu_si512(p);
                    for (int i = 0; i < ms; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], (__m512bh)wv, (__m512bh)xv[i]);
                }
            }
            for (int r = 0; r < rows; r++)
                for (int i = 0; i < ms; i++) out[(m0 + i) * n + n0 + r] = f32_to_bf16(_mm512_reduce_add_ps(acc[r][i]));
        }
    }
}
#else
/* Several input rows elsewhere (AMD's Zen 4): one weight row at a time against up to ROW_TILE input rows,
 * so the weights are one stream, as in one_row, and each line loaded feeds every row of the tile. Each
 * output sums the same products in the same order as one_row (the same bits at every row count). The
 * vocabulary projection's weight on one core, fastest of five passes: 13-14 ms at 3-4 rows, 16 ms at 6,
 * 23 ms at 8, 29 ms at 12 and 45 ms at 16, against 26-28, 34, 37, 47 and 65 ms with 4 weight rows by 4
 * input rows; tiles of several weight rows (4 by 6, 8 by 3) took 22-28 ms at 3-4 rows, and 16 input
 * rows a tile did no better at 16. */
#define ROW_TILE 12

static inline __attribute__((always_inline)) void row_tile(const uint16_t *x, const uint16_t *row, uint16_t *out,
                                                           int64_t n, int64_t k, const int rows, const int ahead) {
    __m512 acc[ROW_TILE];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 32) {
        if (ahead) _mm_prefetch((const char *)(row + j) + 4096, _MM_HINT_T0);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(row + j);
        for (int i = 0; i < rows; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], wv, (__m512bh)_mm512_loadu_si512(x + i * k + j));
    }
    for (int i = 0; i < rows; i++) out[i * n] = f32_to_bf16(_mm512_reduce_add_ps(acc[i]));
}

#define ROW_TILE_CASE(c) case c: row_tile(x + m0 * k, w + r * k, out + m0 * n + r, n, k, c, m0 == 0); break;

static void few_rows(const uint16_t *x, const uint16_t *w, uint16_t *out, int m, int64_t n, int64_t k) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++)
        for (int m0 = 0; m0 < m; m0 += ROW_TILE) {
            switch (m - m0 < ROW_TILE ? m - m0 : ROW_TILE) {
                ROW_TILE_CASE(1) ROW_TILE_CASE(2) ROW_TILE_CASE(3) ROW_TILE_CASE(4) ROW_TILE_CASE(5)
                ROW_TILE_CASE(6) ROW_TILE_CASE(7) ROW_TILE_CASE(8) ROW_TILE_CASE(9) ROW_TILE_CASE(10)
                ROW_TILE_CASE(11) ROW_TILE_CASE(12)
            }
        }
}
#endif
#endif

/* x: (m, k), w: (n, k), out: (m, n), all contiguous bf16; k a multiple of 32. Returns 0, or -1
 * where this build has no AVX512-BF16 or k does not fit. */
int small_batch_linear(const uint16_t *x, const uint16_t *w, uint16_t *out, int m, int64_t n, int64_t k) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (k % 32 || m < 1) return -1;
    if (m == 1) one_row(x, w, out, n, k);
    else few_rows(x, w, out, m, n, k);
    return 0;
#else
    (void)x; (void)w; (void)out; (void)m; (void)n; (void)k;
    return -1;
#endif
}

/* The most input rows of k inputs for which small_batch_linear beats oneDNN on the plain weight, as
 * measured against F.linear on the 0.6B model's shapes, one core: 4 on Xeons with AMX (slower from 8);
 * elsewhere as many as one tile of rows whose inputs fit 24 KB of L1 beside the weight row (12 at 1,024
 * inputs, 4 at 3,072), at least 4. At 1,024 inputs: the vocabulary projection's weight in 0.48-0.71x
 * F.linear's time at 2-12 rows, 0.87x at 16 and 1.38x at 24; 28 q/k/v weights in 0.60-0.87x at 2-12,
 * 1.16x at 16. At 3,072 (28 down weights): 0.66-0.68x at 2-4 rows, 1.40x at 8. */
int small_batch_linear_max_rows(int64_t k) {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && !defined(__AMX_TILE__)
    const int64_t fit = 24 * 1024 / (2 * (k > 0 ? k : 1));
    return fit < 4 ? 4 : fit > ROW_TILE ? ROW_TILE : (int)fit;
#else
    (void)k;
    return 4;
#endif
}

/* 1 if this build can run small_batch_linear. */
int small_batch_linear_supported(void) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
