/* y = x W^T with 8-bit weights (int8 or fp8 e4m3) read as 8-bit and widened in registers.
 *
 * A decode step reads every weight once: at 8 bits a weight is half the bytes of bf16, so the
 * step can stream in about half the time, if widening the bytes costs less than the memory it
 * saves. Each weight row has one float32 scale per block of block_k inputs (fp8: Qwen's 128 x 128
 * blocks, stored expanded to one row of scales per weight row; int8: block_k = k, one scale a row).
 *
 * - q8_linear (a few rows, decode): fp8 on CPUs with AVX512-BF16 and AVX512-VBMI (Zen 4; Xeons
 *   from Sapphire Rapids) is fp8_gemv.h's: the bytes become bf16 by table lookups and meet the
 *   bf16 activations in vdpbf16ps, each block's sum times its scale once. Otherwise (int8; fp8
 *   without those, or with blocks not whole 64-byte lines) 16 weights at a time go from bytes to
 *   float32 lanes (int8: sign-extend and convert; fp8: the e4m3 bits moved into a float16's place
 *   and converted, which gives 2^-8 of the value, subnormals included, the factor folded into the
 *   scale) and meet the activations, widened to float32 once per call, in fused multiply-adds.
 *   That fp8 path multiplies each widened vector by its block's scale first, so the sum is over
 *   float32(q * scale), the weight a float32 dequantization holds; int8 multiplies each row's
 *   float32 sum by its scale once.
 * - q8_linear_amx (more rows: larger decode batches and prefill): each thread turns a block of
 *   32 weight rows into bf16(q * scale) in a buffer that stays in its L2 and runs the AMX tiles of
 *   amx_linear.c over it: the weights still cross memory as bytes.
 * - q8_dequantize: the bf16(q * scale) weight as a whole, for long prompts that oneDNN multiplies.
 *
 * Results are rounded to bf16 once, to nearest even. Without AVX-512 (or AMX) the entry points
 * return -1 and the caller dequantizes in torch.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "bf16.h"
#include "widen8.h" /* widen8x16: 16 weight bytes as float32 */

#if defined(__AVX512F__)
#include <immintrin.h>

#define AI static inline __attribute__((always_inline))

/* The scale that turns a widened weight into its value: fp8 carries the 2^8 of widen8x16. */
AI float scale_at(const float *scales, int64_t row, int64_t blocks, int64_t b, const int fp8) {
    return fp8 ? scales[row * blocks + b] * 256.0f : scales[row * blocks + b];
}

/* Output rows n0..n0+R-1 for input rows m0..m0+MB-1. R and MB are constants at every call, so the
 * loops over them unroll and the R x MB accumulators stay in registers. */
AI void rows_block(const float *xf, const uint8_t *w, const float *scales, uint16_t *out, int m0, int64_t n,
                   int64_t n0, int64_t k, int64_t bk, int prefetch, const int fp8, const int R, const int MB) {
    const int64_t blocks = (k + bk - 1) / bk;
    __m512 acc[8][4]; /* R <= 8, MB <= 4: fixed sizes, so that the compiler keeps them in registers */
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t k0 = b * bk, k1 = k0 + bk < k ? k0 + bk : k;
        __m512 s[8];
        if (fp8)
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) s[r] = _mm512_set1_ps(scale_at(scales, n0 + r, blocks, b, 1));
        for (int64_t j = k0; j < k1; j += 16) {
            __m512 xv[4];
#pragma GCC unroll 4
            for (int i = 0; i < MB; i++) xv[i] = _mm512_loadu_ps(xf + (int64_t)(m0 + i) * k + j);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const uint8_t *p = w + (n0 + r) * k + j;
                if (prefetch && (j & 63) == 0) _mm_prefetch((const char *)(p + R * k), _MM_HINT_T0);
                __m512 wv = widen8x16(p, fp8);
                if (fp8) wv = _mm512_mul_ps(wv, s[r]);
#pragma GCC unroll 4
                for (int i = 0; i < MB; i++) acc[r][i] = _mm512_fmadd_ps(wv, xv[i], acc[r][i]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const float rs = fp8 ? 1.0f : scales[n0 + r];
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) out[(int64_t)(m0 + i) * n + n0 + r] = f32_to_bf16(_mm512_reduce_add_ps(acc[r][i]) * rs);
    }
}

/* Output rows n0..n0+rows-1 (R of them, or one at a time at the end) for input rows m0..m0+MB-1. */
AI void rows_tail(const float *xf, const uint8_t *w, const float *scales, uint16_t *out, int m0, int64_t n,
                  int64_t n0, int rows, int64_t k, int64_t bk, int prefetch, const int fp8, const int R, const int MB) {
    if (rows == R) {
        rows_block(xf, w, scales, out, m0, n, n0, k, bk, prefetch, fp8, R, MB);
        return;
    }
    for (int r = 0; r < rows; r++) rows_block(xf, w, scales, out, m0, n, n0 + r, k, bk, 0, fp8, 1, MB);
}

/* Input rows in groups of 4 (the last group 1 to 4), each over output rows n0..n0+rows-1. */
AI void group_of_rows(const float *xf, const uint8_t *w, const float *scales, uint16_t *out, int m, int64_t n,
                      int64_t n0, int rows, int64_t k, int64_t bk, const int fp8) {
    for (int m0 = 0; m0 < m; m0 += 4) {
        const int prefetch = m0 == 0;
        switch (m - m0 < 4 ? m - m0 : 4) {
            case 4: rows_tail(xf, w, scales, out, m0, n, n0, rows, k, bk, prefetch, fp8, 4, 4); break;
            case 3: rows_tail(xf, w, scales, out, m0, n, n0, rows, k, bk, prefetch, fp8, 4, 3); break;
            case 2: rows_tail(xf, w, scales, out, m0, n, n0, rows, k, bk, prefetch, fp8, 4, 2); break;
            default: rows_tail(xf, w, scales, out, m0, n, n0, rows, k, bk, prefetch, fp8, 4, 1); break;
        }
    }
}

/* The row loops, one function per format: GCC outlines an OpenMP region before it inlines, so a
 * format passed down as a value would reach rows_block as a variable and nothing would specialise. */
#define DEFINE_GEMV(NAME, FP8)                                                                               \
    static void NAME(const float *xf, const uint8_t *w, const float *scales, uint16_t *out, int m, int64_t n, \
                     int64_t k, int64_t bk) {                                                               \
        if (m == 1) {                                                                                        \
            _Pragma("omp parallel for schedule(static)")                                                    \
            for (int64_t n0 = 0; n0 < n; n0 += 8)                                                            \
                rows_tail(xf, w, scales, out, 0, n, n0, n - n0 < 8 ? (int)(n - n0) : 8, k, bk, 1, FP8, 8, 1); \
            return;                                                                                          \
        }                                                                                                    \
        _Pragma("omp parallel for schedule(static)")                                                        \
        for (int64_t n0 = 0; n0 < n; n0 += 4)                                                                \
            group_of_rows(xf, w, scales, out, m, n, n0, n - n0 < 4 ? (int)(n - n0) : 4, k, bk, FP8);         \
    }
DEFINE_GEMV(gemv_int8, 0)
DEFINE_GEMV(gemv_fp8, 1)

/* rows weight rows from w (their scales from scales) as bf16(q * scale), row-major into dst. */
AI void dequantize_rows(const uint8_t *w, const float *scales, uint16_t *dst, int64_t rows, int64_t k, int64_t bk,
                        const int fp8) {
    const int64_t blocks = (k + bk - 1) / bk;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const __m512 s = _mm512_set1_ps(scale_at(scales, r, blocks, b, fp8));
            const int64_t k0 = b * bk, k1 = k0 + bk < k ? k0 + bk : k;
            int64_t j = k0;
#if defined(__AVX512BF16__)
            /* 32 at a time, rounded by the hardware (to nearest even, as round_bf16x16): the dequantizing
             * is most of what the AMX path adds to reading the bytes. */
            for (; j + 32 <= k1; j += 32) {
                const __m512 lo = _mm512_mul_ps(widen8x16(w + r * k + j, fp8), s);
                const __m512 hi = _mm512_mul_ps(widen8x16(w + r * k + j + 16, fp8), s);
                _mm512_storeu_si512(dst + r * k + j, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
#endif
            for (; j < k1; j += 16) {
                const __m512i rounded = round_bf16x16(_mm512_mul_ps(widen8x16(w + r * k + j, fp8), s));
                _mm256_storeu_si256((__m256i *)(dst + r * k + j), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
            }
        }
}

#include "fp8_gemv.h" /* the fp8 decode kernel on AVX512-BF16: gemv_fp8_bf16 */
#endif

/* x: (m, k) bf16; w: (n, k) int8 (fp8 0) or float8_e4m3fn bytes (fp8 1); scales: (n, ceil(k / bk))
 * float32; out: (m, n) bf16. k and bk multiples of 16. Returns 0, or -1 (nothing written). */
int q8_linear(const uint16_t *x, const uint8_t *w, const float *scales, uint16_t *out, int m, int64_t n, int64_t k,
              int64_t bk, int fp8) {
#if defined(__AVX512F__)
    if (m < 1 || k % 16 || bk % 16 || bk < 16) return -1;
#ifdef FP8_BF16
    if (fp8 && k % 32 == 0 && gemv_fp8_bf16(x, w, scales, out, m, n, k, bk) == 0) return 0;
#endif
    float *xf = malloc(sizeof(float) * (size_t)m * k);
    if (!xf) return -1;
    for (int64_t i = 0; i < (int64_t)m * k; i++) xf[i] = bf16_to_f32(x[i]);
    if (fp8) gemv_fp8(xf, w, scales, out, m, n, k, bk);
    else gemv_int8(xf, w, scales, out, m, n, k, bk);
    free(xf);
    return 0;
#else
    (void)x, (void)w, (void)scales, (void)out, (void)m, (void)n, (void)k, (void)bk, (void)fp8;
    return -1;
#endif
}

/* The whole weight as bf16(q * scale) into out (n, k). Returns 0, or -1. */
int q8_dequantize(const uint8_t *w, const float *scales, uint16_t *out, int64_t n, int64_t k, int64_t bk, int fp8) {
#if defined(__AVX512F__)
    if (k % 16 || bk % 16 || bk < 16) return -1;
    const int64_t blocks = (k + bk - 1) / bk;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r += 16) {
        const int64_t rows = n - r < 16 ? n - r : 16;
        if (fp8) dequantize_rows(w + r * k, scales + r * blocks, out + r * k, rows, k, bk, 1);
        else dequantize_rows(w + r * k, scales + r * blocks, out + r * k, rows, k, bk, 0);
    }
    return 0;
#else
    (void)w, (void)scales, (void)out, (void)n, (void)k, (void)bk, (void)fp8;
    return -1;
#endif
}

int q8_linear_supported(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
int q8_amx_supported(void) { return request_tile_state(); }

/* As q8_linear, on AMX tiles; n and k multiples of 32. x is packed once in pairs of 16-row groups
 * (as amx_linear does); each thread takes blocks of 32 weight rows, dequantizes each into its
 * buffer once, and runs every group pair over it. */
int q8_linear_amx(const uint16_t *x, const uint8_t *w, const float *scales, uint16_t *out, int m, int64_t n,
                  int64_t k, int64_t bk, int fp8) {
    if (m < 1 || n % 32 || k % 32 || bk % 16 || bk < 16) return -1;
    const int64_t steps = k / 32, blocks = (k + bk - 1) / bk;
    const int64_t groups = ((m + 31) / 32) * 2;
    uint32_t *packed = aligned_alloc(64, (size_t)groups * steps * 256 * sizeof(uint32_t));
    if (!packed) return -1;
    const int tile_rows0 = m <= 32 ? group_rows(m, 0) : 16;
    const int tile_rows1 = m <= 32 ? group_rows(m, 16) : 16;
    int failed = 0;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int rows = group_rows(m, g * 16);
            if (rows) pack_rows(x, packed + g * steps * 256, (int)(g * 16), rows, k);
        }
        uint16_t *deq = aligned_alloc(64, (size_t)32 * k * sizeof(uint16_t));
        if (!deq) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            configure(tile_rows0, tile_rows1 ? tile_rows1 : 1);
            float c[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
            for (int64_t n0 = 0; n0 < n; n0 += 32) {
                if (fp8) dequantize_rows(w + n0 * k, scales + n0 * blocks, deq, 32, k, bk, 1);
                else dequantize_rows(w + n0 * k, scales + n0 * blocks, deq, 32, k, bk, 0);
                const uint16_t *w0 = deq, *w1 = deq + 16 * k;
                for (int64_t g = 0; g < groups; g += 2) {
                    const uint32_t *b0 = packed + g * steps * 256, *b1 = b0 + steps * 256;
                    const int m0 = (int)(g * 16), rows0 = group_rows(m, m0), rows1 = group_rows(m, m0 + 16);
                    tile_block(w0, w1, k * 2, 32, NULL, b0, b1, steps, rows0, rows1, 0, c, out, n0, n, m0);
                }
            }
            _tile_release();
        }
        free(deq);
    }
    free(packed);
    return failed ? -1 : 0;
}

#else

int q8_amx_supported(void) { return 0; }

int q8_linear_amx(const uint16_t *x, const uint8_t *w, const float *scales, uint16_t *out, int m, int64_t n,
                  int64_t k, int64_t bk, int fp8) {
    (void)x, (void)w, (void)scales, (void)out, (void)m, (void)n, (void)k, (void)bk, (void)fp8;
    return -1;
}

#endif
