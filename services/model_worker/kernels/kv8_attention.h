/* The 8-bit KV caches' decode-attention steps with a bf16 query (paged_attention.c's chunk_q8b and chunk_q8i,
 * docs/kv-cache.md). Included by paged_attention.c after its AVX-512 helpers (Scratch, sum16, softmax_step,
 * prefetch_row, widen8x16, SUB, Q8_AHEAD), where they run in its one-pass shape: a step of SUB keys scored,
 * the online softmax's update, the step's values summed.
 */
#ifndef VLLM_V0_KV8_ATTENTION_H
#define VLLM_V0_KV8_ATTENTION_H

/* Row `at` of a chunk: by stride from `run` where the chunk's slots are one run of ids, else from `rows`. */
#define ROW8(run, rows, at) ((run) ? (run) + (size_t)(at) * row_bytes : (rows)[at])

/* Whether acc holds an fp8 row in widen64_bf16's order (4 vectors per 64 dimensions: w0's even and odd
 * words, w1's even and odd), else in order; where dimension d sits. */
#define Q8B_TABLE_VALUES(FP8, G) ((FP8) && (G) <= 4)
static inline int q8b_acc_index(int d) {
    const int c = d / 64, e = d % 64, k = (e / 16) * 8 + e % 8;
    return c * 64 + ((e % 16 >= 8) * 2 + (k & 1)) * 16 + k / 2;
}

/* Where dimension d sits in a row of acc: per 32 dimensions, the unpacked low then high words' order. */
static inline int q8i_acc_index(int d) {
    const int e = d % 32;
    return d - e + (e % 8 >= 4) * 16 + (e / 8) * 4 + e % 4;
}

#if defined(BF16_PATH) && defined(__AVX512VBMI__)
#define Q8B_PATH 1
/* An 8-bit cache with a bf16 query, on AVX512-BF16 + VBMI: each 64 bytes of a row become 64 bf16 by byte-table
 * lookups (vpermi2b on the byte's low seven bits: the bf16's high and low bytes), exact for every int8 and
 * e4m3 value, and keys meet the bf16 query, unwidened, in vdpbf16ps, as the bf16 cache's keys do
 * (kernels/fp8_gemv.h widens fp8 weights the same way). Widening each 16 bytes to float32 and one FMA per
 * product kept the core compute-bound at about 15 GB/s of cache at 16 x 1,024 tokens on one Zen 4 core. */

/* byte_tables' layout: 128 entries each of the high bytes, the low bytes, and (int8) the high and low bytes
 * of -128..-1 by their low seven bits. fp8's sign is or-ed in apart. */
#define TABLE_BYTES 512
static void kv8_byte_tables(uint8_t *t, int fp8) {
    for (int v = 0; v < 128; v++) {
        const float x = fp8 ? e4m3_to_f32((uint8_t)v) : (float)v, n = (float)(v - 128);
        uint32_t xb, nb;
        memcpy(&xb, &x, 4);
        memcpy(&nb, &n, 4);
        if (x != x) xb = 0x7FC00000u; /* the NaN byte: bf16's quiet NaN */
        /* every value is a bf16 exactly: its float32's low half is zero */
        t[v] = (uint8_t)(xb >> 24), t[128 + v] = (uint8_t)(xb >> 16);
        t[256 + v] = (uint8_t)(nb >> 24), t[384 + v] = (uint8_t)(nb >> 16);
    }
}

/* 64 cache bytes as 64 bf16 in two vectors: w0 holds bytes 0-7, 16-23, 32-39 and 48-55, w1 the others (the
 * order unpacking bytes into words leaves; q8b_query lays the query out to match). t: the 8 table vectors. */
static inline __attribute__((always_inline)) void widen64_bf16(const __m512i b, const __m512i *t, const int FP8,
                                                               __m512i *w0, __m512i *w1) {
    __m512i hi, lo;
    if (FP8) {
        hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t[0], b, t[1]), b, _mm512_set1_epi8((char)0x80),
                                       0xF8); /* table | (b & sign) */
        lo = _mm512_permutex2var_epi8(t[2], b, t[3]);
    } else {
        const __mmask64 neg = _mm512_movepi8_mask(b);
        hi = _mm512_mask_blend_epi8(neg, _mm512_permutex2var_epi8(t[0], b, t[1]), _mm512_permutex2var_epi8(t[4], b, t[5]));
        lo = _mm512_mask_blend_epi8(neg, _mm512_permutex2var_epi8(t[2], b, t[3]), _mm512_permutex2var_epi8(t[6], b, t[7]));
    }
    *w0 = _mm512_unpacklo_epi8(lo, hi);
    *w1 = _mm512_unpackhi_epi8(lo, hi);
}

/* A bf16 query row of D (a multiple of 64) into qb: per 64 dimensions, the words widen64_bf16's w0 and w1 meet. */
static inline void q8b_query(const uint16_t *row, int D, __m512i *qb) {
    for (int c = 0; c < D / 64; c++) {
        const __m512i x = _mm512_loadu_si512(row + 64 * c), y = _mm512_loadu_si512(row + 64 * c + 32);
        qb[2 * c] = _mm512_shuffle_i64x2(x, y, 0x88);
        qb[2 * c + 1] = _mm512_shuffle_i64x2(x, y, 0xDD);
    }
}

/* chunk_q8's pass with keys scored by vdpbf16ps on qb (G rows of C = head_dim / 64 vector pairs, q8b_query),
 * each score times kf (the softmax scale, and fp8's k_scale) or, int8, times the scale and its row's scale.
 * Values: fp8 (G <= 4) widened by the tables and split into float32 by a shift and a mask as the bf16 path's
 * (acc in Q8B_TABLE_VALUES's order); int8, and fp8 at G 8, widened to float32 16 at a time (widen8x16, acc in
 * order; fp8's 2^-8 then goes with v_scale). Each value's weight is times its row's scale first for int8. */
static inline __attribute__((always_inline)) void chunk_q8b(Scratch *w, const char *k_run, const char *v_run,
                                                             const float *ks, const float *vs, const __m512i *qb, const uint8_t *tables,
                                                             const int G, const int C, const int FP8, float kf,
                                                             int n, int avail, int fetch, float *max, float *sum) {
    const char *const *keys = w->keys, *const *values = w->keys + VALUES_AT;
    const size_t row_bytes = (size_t)C * 64;
    const int KB = 16 / G, D = C * 64;
    __m512i t[8];
    for (int i = 0; i < (FP8 ? 4 : 8); i++) t[i] = _mm512_loadu_si512(tables + 64 * i);
    float scores[8][SUB] __attribute__((aligned(64)));
    for (int j0 = 0; j0 < n; j0 += SUB) {
        const int m = n - j0 < SUB ? n - j0 : SUB;
        const __mmask16 live = (__mmask16)((1u << m) - 1);
        __m512 sv[8];
        for (int p = 0; p < G; p++) sv[p] = _mm512_setzero_ps(); /* passes past the step's keys: masked below */
        for (int i0 = 0; i0 < m; i0 += KB) {
            const int k = m - i0 < KB ? m - i0 : KB;
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            for (int i = 0; i < KB; i++) {
                const int at = j0 + i0 + (i < k ? i : 0); /* a short group repeats its first key, sums unused */
                const uint8_t *key = (const uint8_t *)ROW8(k_run, keys, at);
                if (fetch && i < k && at + Q8_AHEAD < avail) {
                    prefetch_row(ROW8(k_run, keys, at + Q8_AHEAD), row_bytes);
                    prefetch_row(ROW8(v_run, values, at + Q8_AHEAD), row_bytes);
                }
                for (int c = 0; c < C; c++) {
                    __m512i w0, w1;
                    widen64_bf16(_mm512_loadu_si512(key + 64 * c), t, FP8, &w0, &w1);
                    for (int r = 0; r < G; r++) {
                        acc[r * KB + i] = _mm512_dpbf16_ps(acc[r * KB + i], (__m512bh)qb[(r * C + c) * 2], (__m512bh)w0);
                        acc[r * KB + i] = _mm512_dpbf16_ps(acc[r * KB + i], (__m512bh)qb[(r * C + c) * 2 + 1],
                                                           (__m512bh)w1);
                    }
                }
            }
            sv[i0 / KB] = sum16(acc);
        }
        __m512 rows[8];
        step_rows(sv, G, rows);
        const __m512 key_factors = FP8 ? _mm512_set1_ps(kf) : _mm512_mul_ps(_mm512_maskz_loadu_ps(live, ks + j0),
                                                                            _mm512_set1_ps(kf));
        float correction[8];
        for (int r = 0; r < G; r++) {
            const __m512 e =
                softmax_step_v(_mm512_mul_ps(rows[r], key_factors), live, &max[r], &sum[r], &correction[r]);
            _mm512_store_ps(scores[r], FP8 ? e : _mm512_mul_ps(e, _mm512_maskz_loadu_ps(live, vs + j0)));
        }
        if (Q8B_TABLE_VALUES(FP8, G)) {
            const int CB = 4 / G > 0 ? (4 / G < C ? 4 / G : C) : 1; /* 64-byte pieces a pass: 4 G CB sums */
            const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
            for (int c0 = 0; c0 < C; c0 += CB) {
                const int cs = C - c0 < CB ? C - c0 : CB;
                __m512 sums[16];
                for (int r = 0; r < G; r++)
                    for (int u = 0; u < 4 * cs; u++)
                        sums[r * 4 * CB + u] = _mm512_mul_ps(_mm512_loadu_ps(w->acc + (size_t)r * D + 64 * c0 + 16 * u),
                                                             _mm512_set1_ps(correction[r]));
                for (int j = 0; j < m; j++) {
                    const uint8_t *row = (const uint8_t *)ROW8(v_run, values, j0 + j);
                    __m512 p[4];
                    for (int r = 0; r < G; r++) p[r] = _mm512_set1_ps(scores[r][j]);
                    for (int c = 0; c < cs; c++) {
                        __m512i w0, w1;
                        widen64_bf16(_mm512_loadu_si512(row + 64 * (c0 + c)), t, FP8, &w0, &w1);
                        const __m512 v[4] = {_mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)),
                                             _mm512_castsi512_ps(_mm512_and_si512(w0, high)),
                                             _mm512_castsi512_ps(_mm512_slli_epi32(w1, 16)),
                                             _mm512_castsi512_ps(_mm512_and_si512(w1, high))};
                        for (int r = 0; r < G; r++)
                            for (int u = 0; u < 4; u++)
                                sums[r * 4 * CB + 4 * c + u] = _mm512_fmadd_ps(p[r], v[u], sums[r * 4 * CB + 4 * c + u]);
                    }
                }
                for (int r = 0; r < G; r++)
                    for (int u = 0; u < 4 * cs; u++)
                        _mm512_storeu_ps(w->acc + (size_t)r * D + 64 * c0 + 16 * u, sums[r * 4 * CB + u]);
            }
        } else {
            const int C16 = C * 4, CB = G >= 8 ? 2 : 16 / G; /* G CB value sums stay in registers */
            for (int c0 = 0; c0 < C16; c0 += CB) {
                const int cs = C16 - c0 < CB ? C16 - c0 : CB;
                __m512 sums[16];
                for (int r = 0; r < G; r++)
                    for (int c = 0; c < cs; c++)
                        sums[r * CB + c] = _mm512_mul_ps(_mm512_loadu_ps(w->acc + (size_t)r * D + 16 * (c0 + c)),
                                                         _mm512_set1_ps(correction[r]));
                for (int j = 0; j < m; j++) {
                    const uint8_t *row = (const uint8_t *)ROW8(v_run, values, j0 + j);
                    __m512 p[8];
                    for (int r = 0; r < G; r++) p[r] = _mm512_set1_ps(scores[r][j]);
                    for (int c = 0; c < cs; c++) {
                        const __m512 v = widen8x16(row + 16 * (c0 + c), FP8);
                        for (int r = 0; r < G; r++) sums[r * CB + c] = _mm512_fmadd_ps(p[r], v, sums[r * CB + c]);
                    }
                }
                for (int r = 0; r < G; r++)
                    for (int c = 0; c < cs; c++)
                        _mm512_storeu_ps(w->acc + (size_t)r * D + 16 * (c0 + c), sums[r * CB + c]);
            }
        }
    }
}

#define CHUNK_Q8B_C(G, F)                                                                                \
    switch (C) {                                                                                         \
    case 1: chunk_q8b(w, k_run, v_run, ks, vs, qb, tables, G, 1, F, kf, n, avail, fetch, max, sum); break;     \
    case 2: chunk_q8b(w, k_run, v_run, ks, vs, qb, tables, G, 2, F, kf, n, avail, fetch, max, sum); break;     \
    case 4: chunk_q8b(w, k_run, v_run, ks, vs, qb, tables, G, 4, F, kf, n, avail, fetch, max, sum); break;     \
    default: chunk_q8b(w, k_run, v_run, ks, vs, qb, tables, G, C, F, kf, n, avail, fetch, max, sum);           \
    }
#define CHUNK_Q8B_G(F)                                                                                   \
    switch (group) {                                                                                     \
    case 1: CHUNK_Q8B_C(1, F); break;                                                                    \
    case 2: CHUNK_Q8B_C(2, F); break;                                                                    \
    case 4: CHUNK_Q8B_C(4, F); break;                                                                    \
    case 8: CHUNK_Q8B_C(8, F); break;                                                                    \
    }
/* C: head_dim / 64; group 1, 2, 4 or 8. */
static void chunk_q8b_of(Scratch *w, const char *k_run, const char *v_run, const float *ks, const float *vs,
                         const __m512i *qb, const uint8_t *tables, int group, int C, int fp8, float kf,
                         int n, int avail, int fetch, float *max, float *sum) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    /* With VNNI every int8 cache this path could take goes to chunk_q8i instead (attend checks it first, and it
     * takes every head size this one does): only fp8 is built here. */
    (void)fp8;
    CHUNK_Q8B_G(1)
#else
    if (fp8) CHUNK_Q8B_G(1) else CHUNK_Q8B_G(0)
#endif
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q8I_PATH 1
/* An int8 cache with a bf16 query, on AVX512-VNNI: integers multiplied by vpdpwssd (32 int16 products an
 * instruction, summed exactly in int32). Each key row sign-extended to int16 meets the query rounded once
 * to int16 (q16: to 2^-15 of the row's largest |q|, its scale applied to the sum); the values meet each
 * step's weights (softmax weight times the row's scale) rounded to int16 against the step's largest, two
 * value rows interleaved a vpdpwssd, the step's int32 sums scaled into the float32 acc once.
 * Widening to float32 and one FMA per product kept one Zen 4 core compute-bound at about 15 GB/s of cache.
 * A step's scores and weights stay in registers from the keys' sums to the values' weights: through memory
 * (scalar stores, a vector load), a 2 x 1,024-token decode with rows in the L3 took 12.9 ns a row and KV head
 * on one Zen 4 core, against 10.4-10.7 with the int32 reduction below. */

/* A bf16 query row of D (a multiple of 16) into q16 (int16), rounded to nearest even; returns the scale
 * (q ~ q16 * scale), 0 for a row of zeros. Eight bits (vpdpbusd's) would be too few: a query rounded to 2^-7 of
 * its largest value moved sharp attention's outputs by up to 0.04 (every int8 byte, head size 128). */
static float q8i_query(const uint16_t *row, int D, int16_t *q16) {
    __m512 amax = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(row, ELEM_BF16, d)));
    const float top = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
    for (int d = 0; d < D; d += 16)
        _mm256_storeu_si256((__m256i *)(q16 + d),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(load16(row, ELEM_BF16, d), inv))));
    return top / 32767.0f;
}

/* sum16 in int32, so that a pass's sixteen sums are converted to float32 once, not each vector (9.9 against
 * 10.8 ns a row and KV head in chunk_q8i, rows in the L3, one Zen 4 core). A row's sum is at most
 * 256 x 128 x 32767 = 2^30 in size. */
static inline __m512i sum16_epi32(const __m512i v[16]) {
    __m512i s[8], t[4], u[2];
    for (int i = 0; i < 8; i++)
        s[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(s[2 * i], s[2 * i + 1]),
                                _mm512_unpackhi_epi64(s[2 * i], s[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        u[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(t[2 * i], t[2 * i + 1], 0x88),
                                _mm512_shuffle_i32x4(t[2 * i], t[2 * i + 1], 0xDD));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x88), _mm512_shuffle_i32x4(u[0], u[1], 0xDD));
}

/* A chunk of n keys (w->keys as chunk_q8 takes them) in steps of SUB keys. q16: G rows of D = 32 C; qf[r]:
 * row r's score factor (the softmax scale times its q16 scale), each score then times its key's row scale. A
 * step's scores and weights stay in registers. Its weights are rounded against their own largest, not against
 * the step's largest row scale (which no weight can pass, and which needs no wait on the softmax): a key that
 * takes nearly all the weight with a value row far smaller than its neighbours' (an attention sink) kept too
 * few bits that way, and from memory the two took the same time. */
static inline __attribute__((always_inline)) void chunk_q8i(Scratch *w, const char *k_run, const char *v_run,
                                                             const float *ks, const float *vs, const int16_t *q16, const float *qf,
                                                             const int G, const int C, int n, int avail, int fetch,
                                                             float *max, float *sum) {
    const char *const *keys = w->keys, *const *values = w->keys + VALUES_AT;
    const size_t row_bytes = (size_t)C * 32;
    const int KB = 16 / G, D = C * 32;
    const int CB = 8 / G; /* 32-dimension pieces of a value pass: 2 G CB int32 sums in registers */
    __m512i qv[8 * 8];
    for (int i = 0; i < G * C; i++) qv[i] = _mm512_loadu_si512(q16 + 32 * i);
    int32_t pairs[8][SUB / 2] __attribute__((aligned(64)));
    for (int j0 = 0; j0 < n; j0 += SUB) {
        const int m = n - j0 < SUB ? n - j0 : SUB;
        const __mmask16 live = (__mmask16)((1u << m) - 1);
        __m512 sv[8];
        for (int p = 0; p < G; p++) sv[p] = _mm512_setzero_ps(); /* passes past the step's keys: masked below */
        for (int i0 = 0; i0 < m; i0 += KB) {
            const int k = m - i0 < KB ? m - i0 : KB;
            __m512i acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_si512();
#pragma GCC unroll 16
            for (int i = 0; i < KB; i++) {
                const int at = j0 + i0 + (i < k ? i : 0); /* a short group repeats its first key, sums unused */
                const int8_t *key = (const int8_t *)ROW8(k_run, keys, at);
                if (fetch && i < k && at + Q8_AHEAD < avail) {
                    prefetch_row(ROW8(k_run, keys, at + Q8_AHEAD), row_bytes);
                    prefetch_row(ROW8(v_run, values, at + Q8_AHEAD), row_bytes);
                }
                for (int c = 0; c < C; c++) {
                    const __m512i k16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(key + 32 * c)));
                    for (int r = 0; r < G; r++) acc[r * KB + i] = _mm512_dpwssd_epi32(acc[r * KB + i], k16, qv[r * C + c]);
                }
            }
            sv[i0 / KB] = _mm512_cvtepi32_ps(sum16_epi32(acc));
        }
        __m512 rows[8];
        step_rows(sv, G, rows);
        const __m512 key_scales = _mm512_maskz_loadu_ps(live, ks + j0);
        const __m512 row_scales = _mm512_maskz_loadu_ps(live, vs + j0);
        float correction[8], step_scale[8];
        for (int r = 0; r < G; r++) {
            const __m512 s = _mm512_mul_ps(rows[r], _mm512_mul_ps(key_scales, _mm512_set1_ps(qf[r])));
            const __m512 e = softmax_step_v(s, live, &max[r], &sum[r], &correction[r]);
            const __m512 wt = _mm512_mul_ps(e, row_scales);
            const float wmax = _mm512_reduce_max_ps(wt);
            step_scale[r] = wmax / 32767.0f;
            const __m512 weights = _mm512_mul_ps(wt, _mm512_set1_ps(wmax > 0.0f ? 32767.0f / wmax : 0.0f));
            _mm256_store_si256((__m256i *)pairs[r], _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(weights)));
        }
        for (int c0 = 0; c0 < C; c0 += CB) {
            const int cs = C - c0 < CB ? C - c0 : CB;
            __m512i sums[16];
            for (int i = 0; i < 2 * G * CB; i++) sums[i] = _mm512_setzero_si512();
            for (int t = 0; 2 * t < m; t++) {
                const int8_t *row_a = (const int8_t *)ROW8(v_run, values, j0 + 2 * t);
                const int8_t *row_b = 2 * t + 1 < m ? (const int8_t *)ROW8(v_run, values, j0 + 2 * t + 1) : row_a; /* weight 0 */
                __m512i p[8];
                for (int r = 0; r < G; r++) p[r] = _mm512_set1_epi32(pairs[r][t]);
                for (int c = 0; c < cs; c++) {
                    const __m512i a16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(row_a + 32 * (c0 + c))));
                    const __m512i b16 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(row_b + 32 * (c0 + c))));
                    const __m512i lo = _mm512_unpacklo_epi16(a16, b16), hi = _mm512_unpackhi_epi16(a16, b16);
                    for (int r = 0; r < G; r++) {
                        sums[(r * CB + c) * 2] = _mm512_dpwssd_epi32(sums[(r * CB + c) * 2], lo, p[r]);
                        sums[(r * CB + c) * 2 + 1] = _mm512_dpwssd_epi32(sums[(r * CB + c) * 2 + 1], hi, p[r]);
                    }
                }
            }
            for (int r = 0; r < G; r++) {
                const __m512 f = _mm512_set1_ps(correction[r]), ss = _mm512_set1_ps(step_scale[r]);
                for (int u = 0; u < 2 * cs; u++) {
                    float *at = w->acc + (size_t)r * D + 32 * c0 + 16 * u;
                    _mm512_storeu_ps(at, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r * CB * 2 + u]), ss,
                                                         _mm512_mul_ps(_mm512_loadu_ps(at), f)));
                }
            }
        }
    }
}

#define CHUNK_Q8I_C(G)                                                                                   \
    switch (C) {                                                                                         \
    case 1: chunk_q8i(w, k_run, v_run, ks, vs, q16, qf, G, 1, n, avail, fetch, max, sum); break;               \
    case 2: chunk_q8i(w, k_run, v_run, ks, vs, q16, qf, G, 2, n, avail, fetch, max, sum); break;               \
    case 4: chunk_q8i(w, k_run, v_run, ks, vs, q16, qf, G, 4, n, avail, fetch, max, sum); break;               \
    case 8: chunk_q8i(w, k_run, v_run, ks, vs, q16, qf, G, 8, n, avail, fetch, max, sum); break;               \
    default: chunk_q8i(w, k_run, v_run, ks, vs, q16, qf, G, C, n, avail, fetch, max, sum);                     \
    }
/* C: head_dim / 32; group 1, 2, 4 or 8. */
static void chunk_q8i_of(Scratch *w, const char *k_run, const char *v_run, const float *ks, const float *vs,
                         const int16_t *q16, const float *qf, int group, int C, int n, int avail, int fetch,
                         float *max, float *sum) {
    switch (group) {
    case 1: CHUNK_Q8I_C(1); break;
    case 2: CHUNK_Q8I_C(2); break;
    case 4: CHUNK_Q8I_C(4); break;
    case 8: CHUNK_Q8I_C(8); break;
    }
}
#endif

#endif
