/* y = x W^T with int8 weights (one float32 scale per output row) and the activations quantized to int8 on
 * the fly (one float32 scale per input row): integer dot products, the weights never widened.
 *
 * q8_linear.c widens the weight bytes to float32 (a few rows) or dequantizes blocks of them to bf16 for the
 * AMX-BF16 tiles (more rows); at decode batches that dequantizing costs as much as the bytes save. Here
 * the activations are made int8 instead, once a call (they are a few rows against thousands of weight
 * rows), and the weights go from memory into integer units as they are:
 * - w8a8_linear_amx (decode batches): AMX-INT8 tiles, the weights loaded straight from their (N, K)
 *   row-major layout as A tiles (16 rows x 64 bytes), the activations packed as B tiles (groups of 4
 *   consecutive K values of a row in one 32-bit word), int32 sums.
 * - w8a8_linear (CPUs with AVX512-VNNI and no AMX-INT8, every row count): register tiles of up to 6 input
 *   rows x 64 outputs, vpdpbusd, on the weight packed once at load (quantize.py's pack_int8_vnni): groups
 *   of 64 outputs (the last one N % 64 wide), each held as (K / 4, width, 4), so that a 64-byte line is 16
 *   outputs x 4 consecutive inputs, and a step of 4 inputs is one to four contiguous lines. Each line is
 *   multiplied by a row's 4 inputs broadcast to every lane: no horizontal sums, and each thread reads its
 *   groups as one stream straight through (a Zen 4 core streams one run of consecutive lines fastest; see
 *   vnni_linear.c). dpbusd multiplies unsigned by signed bytes: the weights are held + 128 (unsigned) and
 *   128 x the quantized row's sum, taken once a row in the call, comes off each sum.
 *
 * Activation row i: s_i = max|x_i| / 127 (float32); q = x / s rounded to nearest even (as torch.round),
 * 0 for an all-zero row (s_i = 0). Result: bf16(float(sum_k q_ik w_nk) * w_scale_n * s_i), rounded once to
 * nearest even. The int32 sums are exact (|sum| <= 127 * 127 * K). Where the compiler or CPU lacks the
 * instructions the entry points return -1 and the *_supported functions 0.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "bf16.h"
#include "l2_share.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#define W8A8_AVX512 1
#define AI static inline __attribute__((always_inline))

/* Row x (k bf16 values) as int8 into q (k bytes, then zeros up to kp); returns its scale, and 128 x the sum of
 * q into offset where it is not NULL. Division, not a multiply by 127 / max: x / s is then the float32
 * quotient torch computes, rounded the same way. */
static float quantize_row(const uint16_t *x, int8_t *q, int64_t k, int64_t kp, int32_t *offset) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j += 16) {
        const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + j))), 16);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_castsi512_ps(bits)));
    }
    const float scale = _mm512_reduce_max_ps(amax) / 127.0f;
    if (scale == 0.0f) {
        memset(q, 0, (size_t)kp);
        if (offset) *offset = 0;
        return 0.0f;
    }
    const __m512 s = _mm512_set1_ps(scale);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t j = 0; j < k; j += 16) {
        const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + j))), 16);
        const __m512 v = _mm512_div_ps(_mm512_castsi512_ps(bits), s);
        const __m512i r = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(q + j), _mm512_cvtsepi32_epi8(r));
        sum = _mm512_add_epi32(sum, r);
    }
    if (kp > k) memset(q + k, 0, (size_t)(kp - k));
    if (offset) *offset = 128 * _mm512_reduce_add_epi32(sum);
    return scale;
}

/* 16 int32 sums (16 output rows n0.. of input row i) as bf16(sum * w_scale * x_scale) into out. */
AI void store_row(__m512i sums, const float *w_scales, float x_scale, uint16_t *out) {
    const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_loadu_ps(w_scales)),
                                   _mm512_set1_ps(x_scale));
    _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16x16(v), 16)));
}
#endif

#if defined(W8A8_AVX512) && defined(__AVX512VNNI__)

#define GROUP 64       /* outputs in a packed group: four vectors of 16 */
#define ROW_TILE 6     /* input rows in a register tile: 6 x 4 accumulators, 4 weight lines, a broadcast */
#define ROW_CHUNK 192  /* rows whose int8 activations stay in cache while the weights of a group pass them */
/* How far ahead in a group's stream the first row tile asks for its lines. Over the 0.6B model's matmuls on one
 * core of an AMD EPYC Zen 4, against 1 KB ahead: 2 KB took 0.99x / 0.94x / 0.94x the time at 1 / 8 / 16 rows,
 * 4 KB 1.02x / 0.91x / 0.95x (11 rounds in turns). */
#define PREFETCH_BYTES 2048

/* acc += the products of w's unsigned bytes and a's signed ones, 4 to a lane. In asm: with the intrinsic, GCC 12
 * moved each accumulator through another register (or the stack) around every vpdpbusd of the inner loop, and
 * 128 rows over the 0.6B model's matmuls took 1.7x as long (AMD EPYC Zen 4). */
AI void dpbusd(__m512i *acc, __m512i w, __m512i a) { __asm__("vpdpbusd %2, %1, %0" : "+v"(*acc) : "v"(w), "v"(a)); }

/* Rows i0..i0+MR-1 of xq (int8, stride k bytes, read a dword of 4 inputs at a time) against one packed
 * group at g: NB vectors of 16 outputs from n0, each step of 4 inputs NB contiguous 64-byte lines.
 * Every line meets every row's broadcast dword: MR x NB dpbusd, no horizontal sums. MR and NB are
 * constants at every call, so the accumulators stay in registers. */
AI void vnni_tile(const int32_t *xq, const int32_t *offsets, const float *x_scales, const uint8_t *g,
                  const float *w_scales, uint16_t *out, int64_t n, int64_t n0, int64_t k, int64_t i0, int prefetch,
                  l2_share pull, const int MR, const int NB) {
    __m512i acc[6][4];
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) acc[r][b] = _mm512_setzero_si512();
    const int64_t steps = k / 4, line = 64 * NB, row = k / 4;
    const int32_t *xr = xq + i0 * row;
    for (int64_t j = 0; j < steps; j++) {
        const uint8_t *p = g + j * line;
        __m512i wv[4];
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++) {
            if (prefetch) _mm_prefetch((const char *)(p + PREFETCH_BYTES + 64 * b), _MM_HINT_T0);
            wv[b] = _mm512_loadu_si512(p + 64 * b);
        }
        l2_share_step(&pull, steps);
#pragma GCC unroll 6
        for (int r = 0; r < MR; r++) {
            const __m512i a = _mm512_set1_epi32(xr[r * row + j]);
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++) dpbusd(&acc[r][b], wv[b], a);
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; r++) {
        const __m512i offset = _mm512_set1_epi32(offsets[i0 + r]);
#pragma GCC unroll 4
        for (int b = 0; b < NB; b++)
            store_row(_mm512_sub_epi32(acc[r][b], offset), w_scales + n0 + 16 * b, x_scales[i0 + r],
                      out + (i0 + r) * n + n0 + 16 * b);
    }
}

#define VNNI_TILE(MR, NB) vnni_tile(xq, offsets, x_scales, g, w_scales, out, n, n0, k, i0, i0 == r0, pull, MR, NB)
#define VNNI_ROWS(NB)                                     \
    switch (rows) {                                       \
        case 1: VNNI_TILE(1, NB); break;                  \
        case 2: VNNI_TILE(2, NB); break;                  \
        case 3: VNNI_TILE(3, NB); break;                  \
        case 4: VNNI_TILE(4, NB); break;                  \
        case 5: VNNI_TILE(5, NB); break;                  \
        default: VNNI_TILE(6, NB); break;                 \
    }

/* Input rows r0..r1-1 against packed group gi, a row tile at a time: the first tile streams the group's
 * weights from memory, the others find them in cache. Where there are several tiles, each also pulls its
 * share of group gi + 1 (the thread's next, under a static schedule) into L2, spread over its steps, so
 * the memory streams while the products run (l2_share.h), as vnni_linear.c's register tiles do. */
static void vnni_group(const int32_t *xq, const int32_t *offsets, const float *x_scales, const uint8_t *w,
                       const float *w_scales, uint16_t *out, int64_t n, int64_t k, int64_t gi, int64_t r0, int64_t r1) {
    const int64_t n0 = gi * GROUP, width = n - n0 < GROUP ? n - n0 : GROUP;
    const uint8_t *g = w + n0 * k;
    const int64_t tiles = (r1 - r0 + ROW_TILE - 1) / ROW_TILE, next_n0 = n0 + GROUP;
    const int64_t next_lines = tiles < 2 || next_n0 >= n ? 0 : (n - next_n0 < GROUP ? n - next_n0 : GROUP) * k / 64;
    for (int64_t i0 = r0, t = 0; i0 < r1; i0 += ROW_TILE, t++) {
        const int64_t rows = r1 - i0 < ROW_TILE ? r1 - i0 : ROW_TILE;
        const l2_share pull = l2_share_of(w + next_n0 * k, next_lines, tiles, t);
        switch (width / 16) {
            case 1: VNNI_ROWS(1) break;
            case 2: VNNI_ROWS(2) break;
            case 3: VNNI_ROWS(3) break;
            default: VNNI_ROWS(4) break;
        }
    }
}

int w8a8_vnni_supported(void) { return 1; }

/* x: (m, k) bf16, any m >= 1; w: the int8 weight (n, k) packed by w8a8_vnni_pack's order (n a multiple of
 * 16); scales: (n, 1) float32 (bk == k); out: (m, n) bf16; k a multiple of 32. fp8 must be 0. Returns 0, or
 * -1 (nothing written). */
int w8a8_linear(const uint16_t *x, const uint8_t *w, const float *scales, uint16_t *out, int m, int64_t n,
                int64_t k, int64_t bk, int fp8) {
    if (fp8 || m < 1 || n % 16 || k % 32 || bk != k) return -1;
    int32_t *xq = aligned_alloc(64, ((size_t)m * (size_t)k + 63) / 64 * 64);
    int32_t *offsets = malloc(sizeof(int32_t) * (size_t)m);
    float *x_scales = malloc(sizeof(float) * (size_t)m);
    if (!xq || !offsets || !x_scales) {
        free(xq), free(offsets), free(x_scales);
        return -1;
    }
    const int64_t groups = (n + GROUP - 1) / GROUP;
    const float *w_scales = scales;
    if (m <= ROW_TILE) {  /* decode: the calling thread quantizes the few rows, and the threads meet once */
        for (int64_t i = 0; i < m; i++)
            x_scales[i] = quantize_row(x + i * k, (int8_t *)xq + i * k, k, k, offsets + i);
#pragma omp parallel for schedule(static)
        for (int64_t gi = 0; gi < groups; gi++) vnni_group(xq, offsets, x_scales, w, w_scales, out, n, k, gi, 0, m);
    } else {
#pragma omp parallel
        {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m; i++)
                x_scales[i] = quantize_row(x + i * k, (int8_t *)xq + i * k, k, k, offsets + i);
            /* The chunks write apart and read only the quantized rows: no thread waits for another between them. */
            for (int64_t r0 = 0; r0 < m; r0 += ROW_CHUNK) {
                const int64_t r1 = r0 + ROW_CHUNK < m ? r0 + ROW_CHUNK : m;
#pragma omp for schedule(static) nowait
                for (int64_t gi = 0; gi < groups; gi++)
                    vnni_group(xq, offsets, x_scales, w, w_scales, out, n, k, gi, r0, r1);
            }
        }
    }
    free(xq), free(offsets), free(x_scales);
    return 0;
}

#else

int w8a8_vnni_supported(void) { return 0; }

int w8a8_linear(const uint16_t *x, const uint8_t *w, const float *scales, uint16_t *out, int m, int64_t n,
                int64_t k, int64_t bk, int fp8) {
    (void)x, (void)w, (void)scales, (void)out, (void)m, (void)n, (void)k, (void)bk, (void)fp8;
    return -1;
}

#endif

#if defined(W8A8_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__)
int w8a8_amx_supported(void) { return request_tile_state(); }

/* A result tile c (16 output rows n0.. by `rows` input rows m0..) into out: a column of c (one input row)
 * is gathered into one vector of 16 sums and stored as bf16. */
static void write_sums(const int32_t *c, const float *w_scales, const float *x_scales, uint16_t *out, int rows,
                       int64_t n0, int64_t n, int m0) {
    const __m512i across = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(16));
    for (int j = 0; j < rows; j++)
        store_row(_mm512_i32gather_epi32(across, c + j, 4), w_scales + n0, x_scales[m0 + j],
                  out + (int64_t)(m0 + j) * n + n0);
}

#define PREFETCH 8       /* steps (cache lines of each of 32 weight rows) ahead */
#ifndef CHUNK_GROUPS
#define CHUNK_GROUPS 32  /* groups of 16 input rows (an even number): 512 rows */
#endif

/* One output block: weight rows n0..n0+31 against input rows m0.. (one or two groups of 16, packed in b0, b1)
 * over `steps` steps of 64 inputs. The last step of a k that is not a multiple of 64 reads the weights
 * from tail (32 rows of 64 bytes, zero-padded): a tile load there would read past the last row. */
static void int8_block(const int8_t *w, const int8_t *tail, const int32_t *b0, const int32_t *b1, int64_t steps,
                       int64_t k, int rows0, int rows1, const float *w_scales, const float *x_scales,
                       int32_t c[4][256], uint16_t *out, int64_t n0, int64_t n, int m0, int prefetch) {
    const int more = n0 + 32 < n;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int64_t whole = tail ? steps - 1 : steps;
    for (int64_t s = 0; s < steps; s++) {
        if (prefetch) { /* the weights stream from memory: ahead into this block's rows, then the next block's */
            const int64_t t = s + PREFETCH;
            const int8_t *ahead = t < whole ? w + t * 64 : (t - steps < whole && more ? w + 32 * k + (t - steps) * 64 : NULL);
            if (ahead)
                for (int r = 0; r < 32; r++) _mm_prefetch((const char *)(ahead + r * k), _MM_HINT_T0);
        }
        if (s < whole) {
            _tile_loadd(4, w + s * 64, k);
            _tile_loadd(5, w + 16 * k + s * 64, k);
        } else {
            _tile_loadd(4, tail, 64);
            _tile_loadd(5, tail + 16 * 64, 64);
        }
        _tile_loadd(6, b0 + s * 256, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(2, 5, 6);
        if (rows1) {
            _tile_loadd(7, b1 + s * 256, 64);
            _tile_dpbssd(1, 4, 7);
            _tile_dpbssd(3, 5, 7);
        }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(2, c[2], 64);
    write_sums(c[0], w_scales, x_scales, out, rows0, n0, n, m0);
    write_sums(c[2], w_scales, x_scales, out, rows0, n0 + 16, n, m0);
    if (rows1) {
        _tile_stored(1, c[1], 64);
        _tile_stored(3, c[3], 64);
        write_sums(c[1], w_scales, x_scales, out, rows1, n0, n, m0 + 16);
        write_sums(c[3], w_scales, x_scales, out, rows1, n0 + 16, n, m0 + 16);
    }
}

/* Rows g * 16 .. g * 16 + 15 of x quantized into xq (rows past m zero, scale 0), then each step of them (16 rows
 * of 16 words, 4 inputs a word) transposed into packed so that a tile row holds one word of every input row,
 * as tdpbssd's B operand takes them. A group past m is never read (its rows count is 0): left as it is. */
static void pack_group(const uint16_t *x, int8_t *xq, int32_t *packed, float *x_scales, int64_t g, int m, int64_t k,
                       int64_t kp, int64_t steps) {
    if (g * 16 >= m) return;
    for (int64_t i = g * 16; i < g * 16 + 16; i++) {
        if (i < m) x_scales[i] = quantize_row(x + i * k, xq + i * kp, k, kp, NULL);
        else memset(xq + i * kp, 0, (size_t)kp), x_scales[i] = 0.0f;
    }
    for (int64_t s = 0; s < steps; s++) {
        __m512i v[16];
        for (int j = 0; j < 16; j++) v[j] = _mm512_load_si512(xq + (g * 16 + j) * kp + s * 64);
        transpose16(v);
        for (int p = 0; p < 16; p++) _mm512_store_si512(packed + (g * steps + s) * 256 + p * 16, v[p]);
    }
}

/* x: (m, k) bf16; w: (n, k) int8; scales: (n, 1) float32 (bk == k); out: (m, n) bf16; n and k multiples of
 * 32. fp8 must be 0. Returns 0, or -1 (nothing written). */
int w8a8_linear_amx(const uint16_t *x, const uint8_t *w, const float *scales, uint16_t *out, int m, int64_t n,
                    int64_t k, int64_t bk, int fp8) {
    if (fp8 || m < 1 || n % 32 || k % 32 || bk != k) return -1;
    const int64_t kp = (k + 63) / 64 * 64, steps = kp / 64;
    const int64_t groups = ((m + 31) / 32) * 2, padded_rows = groups * 16;
    int8_t *xq = aligned_alloc(64, (size_t)(padded_rows * kp));
    int32_t *packed = aligned_alloc(64, (size_t)groups * steps * 256 * sizeof(int32_t));
    float *x_scales = malloc(sizeof(float) * (size_t)padded_rows);
    if (!xq || !packed || !x_scales) {
        free(xq), free(packed), free(x_scales);
        return -1;
    }
    const int tile_rows0 = m <= 32 ? group_rows(m, 0) : 16;
    const int tile_rows1 = m <= 32 ? group_rows(m, 16) : 16;
    /* Up to 32 rows (decode) the calling thread packs them before the threads start: microseconds of work, and
     * the threads then meet once a call, at the end, as the other matmul kernels' do. */
    if (m <= 32)
        for (int64_t g = 0; g < groups; g++) pack_group(x, xq, packed, x_scales, g, m, k, kp, steps);
#pragma omp parallel
    {
        if (m > 32) {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) pack_group(x, xq, packed, x_scales, g, m, k, kp, steps);
        }
        int8_t tail[32 * 64] __attribute__((aligned(64)));
        if (k % 64) memset(tail, 0, sizeof tail);
        configure(tile_rows0, tile_rows1 ? tile_rows1 : 1);
        int32_t c[4][256] __attribute__((aligned(64)));
        const int8_t *wq = (const int8_t *)w;
        /* Long prompts in chunks of CHUNK_GROUPS groups of rows (512), whose packed activations (512 x K bytes
         * at most) stay in cache while the weights stream past them, once a chunk. The chunks write apart and
         * read only the packed rows: no thread waits for another between them. */
        for (int64_t g0 = 0; g0 < groups; g0 += CHUNK_GROUPS) {
            const int64_t g1 = g0 + CHUNK_GROUPS < groups ? g0 + CHUNK_GROUPS : groups;
#pragma omp for schedule(static) nowait
            for (int64_t n0 = 0; n0 < n; n0 += 32) {
                const int8_t *block = wq + n0 * k;
                if (k % 64)
                    for (int r = 0; r < 32; r++) memcpy(tail + r * 64, block + r * k + (steps - 1) * 64, 32);
                for (int64_t g = g0; g < g1; g += 2) {
                    const int32_t *b0 = packed + g * steps * 256, *b1 = b0 + steps * 256;
                    const int m0 = (int)(g * 16), rows0 = group_rows(m, m0), rows1 = group_rows(m, m0 + 16);
                    int8_block(block, k % 64 ? tail : NULL, b0, b1, steps, k, rows0, rows1, scales, x_scales, c,
                               out, n0, n, m0, g == g0);
                }
            }
        }
        _tile_release();
    }
    free(xq), free(packed), free(x_scales);
    return 0;
}

#else

int w8a8_amx_supported(void) { return 0; }

int w8a8_linear_amx(const uint16_t *x, const uint8_t *w, const float *scales, uint16_t *out, int m, int64_t n,
                    int64_t k, int64_t bk, int fp8) {
    (void)x, (void)w, (void)scales, (void)out, (void)m, (void)n, (void)k, (void)bk, (void)fp8;
    return -1;
}

#endif
