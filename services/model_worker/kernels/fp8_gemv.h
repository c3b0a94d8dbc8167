/* fp8 e4m3 weights at a few input rows (decode) on AVX512-BF16: q8_linear.c's fp8 path where the CPU has
 * AVX512-BF16 and AVX512-VBMI. Included by q8_linear.c inside its AVX-512 section (AI, round_bf16x16).
 *
 * Each 64 weight bytes become 64 bf16 by two byte-table lookups (vpermi2b: the bf16's high and low byte
 * for the byte's seven magnitude bits; the sign or-ed in), exact for every e4m3 value, and meet the bf16
 * activations, unwidened, in vdpbf16ps: 32 products an instruction, against 16 for the float32 path,
 * with 8 instructions for 64 weights instead of 24. Per block of block_k inputs the products are summed
 * in float32 (each product exact), and the block's sum is multiplied by its scale once and added to the
 * row's float32 total; 16 rows' totals are summed across lanes together and rounded to bf16 once, to
 * nearest even. Each thread reads its output rows one after another, one run of consecutive lines (on
 * Zen 4 a core streams one run fastest; small_batch_linear.c), each row once for every group of 4 input
 * rows.
 */
#ifndef VLLM_V0_FP8_GEMV_H
#define VLLM_V0_FP8_GEMV_H

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define FP8_BF16 1
/* Bytes ahead in the row stream: on Zen 4, one thread over the 0.6B model's decoder weights, 8 and 16 KB
 * read faster than 0.5-4 KB or none (the hardware's own prefetch alone). */
#ifndef FP8_PREFETCH
#define FP8_PREFETCH 8192
#endif

/* e4m3fn -> bf16 by its seven magnitude bits: the bf16's high bytes (sign added apart) and low bytes. */
typedef struct {
    __m512i hi0, hi1, lo0, lo1;
} e4m3_table;

/* Every e4m3 magnitude is a bf16 exactly (3 mantissa bits, exponents 2^-9 to 2^8), subnormals and zero
 * included, which a shift and an exponent rebias alone would get wrong; the NaN byte becomes bf16's NaN. */
static e4m3_table e4m3_bf16_table(void) {
    uint8_t hi[128] __attribute__((aligned(64))), lo[128] __attribute__((aligned(64)));
    for (int v = 0; v < 128; v++) {
        const int e = v >> 3, mant = v & 7;
        uint16_t h;
        if (v == 127) h = 0x7FC0;
        else if (e) h = (uint16_t)(((e + 120) << 7) | (mant << 4));
        else {
            const float f = (float)mant / 512.0f;
            uint32_t bits;
            memcpy(&bits, &f, 4);
            h = (uint16_t)(bits >> 16);
        }
        hi[v] = (uint8_t)(h >> 8), lo[v] = (uint8_t)h;
    }
    return (e4m3_table){_mm512_load_si512(hi), _mm512_load_si512(hi + 64), _mm512_load_si512(lo),
                        _mm512_load_si512(lo + 64)};
}

/* 64 e4m3 bytes as 64 bf16 in two vectors: w0 holds bytes 0-7, 16-23, 32-39 and 48-55, w1 the others (the
 * order unpacking bytes into words leaves; fp8_activations lays the inputs out to match). */
AI void e4m3_to_bf16x64(const __m512i b, const e4m3_table *t, __m512i *w0, __m512i *w1) {
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t->hi0, b, t->hi1), b,
                                                 _mm512_set1_epi8((char)0x80), 0xF8); /* table | (b & sign) */
    const __m512i lo = _mm512_permutex2var_epi8(t->lo0, b, t->lo1);
    *w0 = _mm512_unpacklo_epi8(lo, hi);
    *w1 = _mm512_unpackhi_epi8(lo, hi);
}

/* x (m, k) into xp (m, kp), kp = k rounded up to 64: each 64 inputs in e4m3_to_bf16x64's order (its 16-byte
 * lanes 0 and 2, then 1 and 3, of each half), zeros past k (k a multiple of 32). */
static void fp8_activations(const uint16_t *x, uint16_t *xp, int m, int64_t k, int64_t kp) {
    for (int i = 0; i < m; i++)
        for (int64_t j = 0; j < kp; j += 64) {
            const __m512i a = _mm512_loadu_si512(x + i * k + j);
            const __m512i b = j + 64 <= k ? _mm512_loadu_si512(x + i * k + j + 32) : _mm512_setzero_si512();
            _mm512_storeu_si512(xp + i * kp + j, _mm512_shuffle_i64x2(a, b, 0x88));
            _mm512_storeu_si512(xp + i * kp + j + 32, _mm512_shuffle_i64x2(a, b, 0xDD));
        }
}

/* 64 weights (their bytes in b) times the inputs at xj of each of MB input rows, into part. */
AI void fp8_step(const __m512i b, const uint16_t *xj, int64_t kp, const e4m3_table *t, __m512 *part, const int MB) {
    __m512i w0, w1;
    e4m3_to_bf16x64(b, t, &w0, &w1);
#pragma GCC unroll 4
    for (int i = 0; i < MB; i++) {
        part[i] = _mm512_dpbf16_ps(part[i], (__m512bh)w0, (__m512bh)_mm512_loadu_si512(xj + i * kp));
        part[i] = _mm512_dpbf16_ps(part[i], (__m512bh)w1, (__m512bh)_mm512_loadu_si512(xj + i * kp + 32));
    }
}

/* One output row for MB input rows: per block, the e4m3 values times the bf16 inputs summed by vdpbf16ps
 * (each product exact in float32), then that block's sum times its scale added to the row's float32 total. */
AI void fp8_row(const uint16_t *xp, int64_t kp, const uint8_t *row, const float *row_scales, __m512 *totals,
                int64_t k, int64_t bk, const e4m3_table t, const int MB, const int whole) {
    __m512 acc[4];
#pragma GCC unroll 4
    for (int i = 0; i < MB; i++) acc[i] = _mm512_setzero_ps();
    const int64_t blocks = (k + bk - 1) / bk;
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t k0 = b * bk, k1 = whole || k0 + bk < k ? k0 + bk : k;
        __m512 part[4];
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) part[i] = _mm512_setzero_ps();
        int64_t j = k0;
        for (; j + 64 <= k1; j += 64) {
            _mm_prefetch((const char *)(row + j) + FP8_PREFETCH, _MM_HINT_T0);
            fp8_step(_mm512_loadu_si512(row + j), xp + j, kp, &t, part, MB);
        }
        if (!whole && j < k1) /* 32 inputs left */
            fp8_step(_mm512_maskz_loadu_epi8(0xFFFFFFFFull, row + j), xp + j, kp, &t, part, MB);
        const __m512 s = _mm512_set1_ps(row_scales[b]);
#pragma GCC unroll 4
        for (int i = 0; i < MB; i++) acc[i] = _mm512_fmadd_ps(part[i], s, acc[i]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < MB; i++) totals[i * 16] = acc[i];
}

/* v[0..15] into one vector whose lane j is the sum of v[j]'s lanes: 45 instructions for 16 outputs where
 * a reduction each took about 10 (pairs within 128-bit lanes, then pairs of pairs, then across lanes). */
AI __m512 sum16(const __m512 *v) {
    __m512 x[8], y[4], z[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

/* Output rows r0..r0+rows-1 (rows <= 16) for input rows in groups of 4 (the last 1 to 4): each group's 16
 * totals of an input row summed at once and rounded to bf16 together. */
AI void fp8_rows(const uint16_t *xp, int64_t kp, const uint8_t *w, const float *scales, uint16_t *out, int m,
                 int64_t n, int64_t k, int64_t bk, const e4m3_table t, const int whole, int64_t r0, int rows) {
    const int64_t blocks = (k + bk - 1) / bk;
    for (int m0 = 0; m0 < m; m0 += 4) {
        const uint16_t *xg = xp + m0 * kp;
        const int mb = m - m0 < 4 ? m - m0 : 4;
        __m512 totals[4 * 16];
        for (int i = 0; i < 4 * 16; i++) totals[i] = _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const uint8_t *row = w + (r0 + r) * k;
            const float *row_scales = scales + (r0 + r) * blocks;
            switch (mb) {
                case 4: fp8_row(xg, kp, row, row_scales, totals + r, k, bk, t, 4, whole); break;
                case 3: fp8_row(xg, kp, row, row_scales, totals + r, k, bk, t, 3, whole); break;
                case 2: fp8_row(xg, kp, row, row_scales, totals + r, k, bk, t, 2, whole); break;
                default: fp8_row(xg, kp, row, row_scales, totals + r, k, bk, t, 1, whole); break;
            }
        }
        for (int i = 0; i < mb; i++) {
            const __m512i rounded = _mm512_srli_epi32(round_bf16x16(sum16(totals + i * 16)), 16);
            _mm256_mask_storeu_epi16(out + (int64_t)(m0 + i) * n + r0, (__mmask16)((1u << rows) - 1),
                                     _mm512_cvtepi32_epi16(rounded));
        }
    }
}

/* fp8 with block sizes of whole 64-byte lines (k a multiple of 32); -1 to leave it to the float32 kernel.
 * Qwen's blocks of 128 over whole blocks (every Qwen3 shape) take a loop with the block size a constant, so
 * that a block's steps unroll and no tail is tested for. */
static int gemv_fp8_bf16(const uint16_t *x, const uint8_t *w, const float *scales, uint16_t *out, int m, int64_t n,
                         int64_t k, int64_t bk) {
    if (bk % 64) return -1;
    const int64_t kp = (k + 63) / 64 * 64;
    uint16_t *xp = malloc(sizeof(uint16_t) * (size_t)m * kp);
    if (!xp) return -1;
    fp8_activations(x, xp, m, k, kp);
    const e4m3_table t = e4m3_bf16_table();
    if (bk == 128 && k % 128 == 0) {
#pragma omp parallel for schedule(static)
        for (int64_t r0 = 0; r0 < n; r0 += 16)
            fp8_rows(xp, kp, w, scales, out, m, n, k, 128, t, 1, r0, n - r0 < 16 ? (int)(n - r0) : 16);
    } else {
#pragma omp parallel for schedule(static)
        for (int64_t r0 = 0; r0 < n; r0 += 16)
            fp8_rows(xp, kp, w, scales, out, m, n, k, bk, t, 0, r0, n - r0 < 16 ? (int)(n - r0) : 16);
    }
    free(xp);
    return 0;
}
#endif

#endif
