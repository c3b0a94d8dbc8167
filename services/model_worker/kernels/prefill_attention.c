/* Causal attention of one prompt's new rows on AMX tiles (or AVX512-BF16), bf16, for a prefill on the CPU.
 *
 * torch's SDPA ran a 0.6B-model layer's attention at 80-140 GFLOP/s on one CPU: 0.8 ms a layer for
 * 128 tokens, 8-10 ms for 512, a fifth of a 512-token prompt's prefill. Here both products run on
 * the matrix unit and the causal half above the diagonal is skipped block by block.
 *
 * Query row i (of lq) sits at position lk - lq + i and attends to keys 0 .. that position. Per KV
 * head, its keys are packed once as B tiles of Q K^T (pairs along the head dim) and its values as
 * B tiles of P V (pairs of keys), read in place from this step's rows or through cache slots. Then
 * for each query head sharing it (two side by side) and each block of 16 query rows: every score
 * the block needs, in float32; an exact softmax over each row's visible keys (its max, then
 * e^(s - max) and their sum in float32); the weights rounded to bf16 for P V, as SDPA rounds them;
 * the result times each row's reciprocal sum, rounded to bf16. A row's arithmetic depends on its
 * own query and keys only, never on its block's other rows or on other prompts.
 *
 * Without AMX (AMD's Zen 4) the same steps run on AVX512-BF16 register tiles (attend_rows), where SDPA
 * took 2.7 ms a layer for 128 tokens and 34 ms for 512 (26-38 GFLOP/s over the causal half): 0.71 ms
 * and 7.1 ms here, 0.21-0.37x its time at 32-768 tokens, and a whole prefill of the 0.6B model in 0.91x
 * the time at 128 tokens and 0.81x at 512 (bench/bench_prefill_attention.py, one core).
 *
 * Built where the compiler targets AVX512-BF16, on AMX tiles where it targets AMX-BF16 too; there
 * prefill_attention_supported() also asks the kernel for the tile state (Linux's arch_prctl), which a
 * process must do once before using AMX.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#include "bf16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "transpose.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PREFILL_AMX 1
int prefill_attention_supported(void) { return request_tile_state(); }
#else
int prefill_attention_supported(void) { return 1; }
#endif

typedef struct {
    const uint16_t *base;
    int64_t stride;        /* row j of head h: base + j * stride + h * D, where slots is NULL */
    const int64_t *slots;  /* else: base + (h * num_slots + slots[j]) * D (a cache) */
    int64_t num_slots;
} Rows;

static inline const uint16_t *row_at(const Rows *r, int64_t j, int h, int d) {
    return r->slots ? r->base + ((int64_t)h * r->num_slots + r->slots[j]) * d : r->base + j * r->stride + (int64_t)h * d;
}

/* Keys as B tiles of Q K^T: for 16 keys and 32 head dims, 16 pairs (rows) by 16 keys (columns), a
 * 16 x 16 transpose of 32-bit words; tile (g, s) at kp + (g * steps + s) * 256 words. Keys past lk
 * are zeros. */
static void pack_keys(const Rows *k, int h, int lk, int d, uint32_t *kp) {
    const int steps = d / 32;
    for (int g = 0; g * 16 < lk; g++)
        for (int s = 0; s < steps; s++) {
            __m512i v[16];
            for (int j = 0; j < 16; j++)
                v[j] = g * 16 + j < lk ? _mm512_loadu_si512(row_at(k, g * 16 + j, h, d) + s * 32) : _mm512_setzero_si512();
            transpose16(v);
            for (int p = 0; p < 16; p++) _mm512_store_si512(kp + ((int64_t)(g * steps + s) * 16 + p) * 16, v[p]);
        }
}

/* Values as B tiles of P V: for 32 keys and 16 head dims, row p holds keys 2p and 2p + 1 of each
 * dim, interleaved; tile (t, c) at vp + (t * chunks + c) * 256 words. Keys past lk are zeros. */
static void pack_values(const Rows *v, int h, int lk, int d, uint32_t *vp) {
    const int chunks = d / 16;
    for (int t = 0; t * 32 < lk; t++)
        for (int p = 0; p < 16; p++) {
            const int j0 = t * 32 + 2 * p, j1 = j0 + 1;
            const uint16_t *r0 = j0 < lk ? row_at(v, j0, h, d) : NULL, *r1 = j1 < lk ? row_at(v, j1, h, d) : NULL;
            for (int c = 0; c < chunks; c++) {
                const __m512i lo = r0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r0 + c * 16)))
                                      : _mm512_setzero_si512();
                const __m512i hi = r1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(r1 + c * 16)))
                                      : _mm512_setzero_si512();
                _mm512_store_si512(vp + ((int64_t)(t * chunks + c) * 16 + p) * 16,
                                   _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
}

/* Scratch of one thread, sized for lk keys of head dim d and `rows` query rows at a time. */
typedef struct {
    uint32_t *kp, *vp;  /* packed keys and values of one KV head */
    float *s, *o;       /* per query row: (width) scores; (d) unnormalised output */
    uint16_t *p, *q;    /* per query row: (width) bf16 weights; (d) the query */
    int width;          /* lk rounded up to 32 */
} Scratch;

static int scratch_alloc(Scratch *w, int lk, int d, int rows) {
    w->width = (lk + 31) / 32 * 32;
    const size_t keys = (size_t)w->width * d;
    w->kp = aligned_alloc(64, keys * 2);
    w->vp = aligned_alloc(64, keys * 2);
    w->s = aligned_alloc(64, (size_t)rows * w->width * 4);
    w->o = aligned_alloc(64, (size_t)rows * d * 4);
    w->p = aligned_alloc(64, (size_t)rows * w->width * 2);
    w->q = aligned_alloc(64, (size_t)rows * d * 2);
    return w->kp && w->vp && w->s && w->o && w->p && w->q ? 0 : -1;
}

static void scratch_free(Scratch *w) {
    free(w->kp), free(w->vp), free(w->s), free(w->o), free(w->p), free(w->q);
}

/* 2^y for y <= 0: an integer power applied exactly (scalef) times 2^f, |f| <= 1/2, by its Taylor
 * polynomial of degree 6 (relative error about 1e-7; the weights are rounded to bf16 after). Base 2
 * with the scale and log2(e) folded into one factor: a multiply and a subtract fewer per score
 * than e^x of scaled scores, in the loop that took a third of the kernel's time. */
static inline __m512 exp2_16(__m512 y) {
    y = _mm512_max_ps(y, _mm512_set1_ps(-150.0f)); /* below this 2^y is 0 in float32 */
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Row r's weights from its n >= 1 visible raw scores: p[j] = e^(scale (s[j] - max)) rounded to
 * bf16, zero from n to `width`; returns their float32 sum. */
static float softmax_row(const float *s, uint16_t *p, int n, int width, float scale) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    const __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
    if (tail) m = _mm512_mask_max_ps(m, tail, m, _mm512_maskz_loadu_ps(tail, s + j));
    const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    const __m512 factor = _mm512_set1_ps(scale * 1.44269504088896341f); /* scale log2(e) */
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j + 16 <= n; j += 16) {
        const __m512 e = exp2_16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), max), factor));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(p + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    if (tail) {
        const __m512 e = _mm512_maskz_mov_ps(tail, exp2_16(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j),
                                                                                         max), factor)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(p + j), (__m256i)_mm512_cvtneps_pbh(e));
        j += 16;
    }
    for (; j < width; j += 16) _mm256_storeu_si256((__m256i *)(p + j), _mm256_setzero_si256());
    return _mm512_reduce_add_ps(sum);
}

#ifdef PREFILL_AMX
/* One block of up to 16 query rows (q0 ..) of query heads h .. h + heads - 1 (one or two, sharing
 * a KV head) against its packed keys and values. Two heads side by side load each key and value
 * tile once for both: the A tiles come from L1, the packed keys and values from L2, and a block of
 * one head loaded a tile from L2 for every multiply. The products and loads go in amx_tiles.h's
 * order (step_products): the 0.6B shape's attention over 28 layers took 0.99x, 0.97x and 0.95x the
 * time of all loads at the top of each step at 128, 512 and 768 tokens, in turns, with the same bits. */
static inline __attribute__((always_inline)) void
attend_block(const Rows *q, uint16_t *out, int64_t out_stride, int h, const int heads, int q0, int rows, int lq,
             int lk, int d, float scale, Scratch *w) {
    const int steps = d / 32, chunks = d / 16, offset = lk - lq;
    const int keys = q0 + rows + offset < lk ? q0 + rows + offset : lk; /* the block's last row sees these */
    const int groups = (keys + 15) / 16, pairs = (keys + 31) / 32;
    const int64_t s_stride = (int64_t)w->width * 4, head_s = 16 * (int64_t)w->width, head_o = 16 * (int64_t)d;
    for (int a = 0; a < heads; a++)
        for (int r = 0; r < 16; r++) {
            uint16_t *dst = w->q + (a * 16 + r) * d;
            if (r < rows) memcpy(dst, row_at(q, q0 + r, h + a, d), (size_t)d * 2);
            else memset(dst, 0, (size_t)d * 2);
        }
    /* Scores, two groups of 16 keys at a time: tile 2 a + u holds head a's scores of group g0 + u. */
    for (int g0 = 0; g0 < groups; g0 += 2) {
        const int two = g0 + 1 < groups;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint32_t *k0 = w->kp + (int64_t)g0 * steps * 256;
        const tile_steps t = {(const char *)w->q, (const char *)(w->q + 16 * d), (const char *)k0,
                              (const char *)(k0 + (int64_t)steps * 256), d * 2, 64, 1024, heads == 2, two};
        load_first_tiles(&t);
        for (int s = 0; s < steps; s++) step_products(&t, s, steps);
        _tile_stored(0, w->s + g0 * 16, s_stride);
        if (two) _tile_stored(1, w->s + (g0 + 1) * 16, s_stride);
        if (heads == 2) {
            _tile_stored(2, w->s + head_s + g0 * 16, s_stride);
            if (two) _tile_stored(3, w->s + head_s + (g0 + 1) * 16, s_stride);
        }
    }
    float sums[2][16];
    for (int a = 0; a < heads; a++)
        for (int r = 0; r < 16; r++) {
            const int visible = r < rows ? (q0 + r + offset + 1 < lk ? q0 + r + offset + 1 : lk) : 0;
            sums[a][r] = softmax_row(w->s + a * head_s + (int64_t)r * w->width, w->p + a * head_s + (int64_t)r * w->width,
                                     visible, pairs * 32, scale);
        }
    /* P V, two chunks of 16 head dims at a time (d / 16 is even): tile 2 a + u holds head a's chunk c0 + u. */
    for (int c0 = 0; c0 < chunks; c0 += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint32_t *v0 = w->vp + (int64_t)c0 * 256;
        const tile_steps t = {(const char *)w->p, (const char *)(w->p + head_s), (const char *)v0,
                              (const char *)(v0 + 256), w->width * 2, 64, (int64_t)chunks * 1024, heads == 2, 1};
        load_first_tiles(&t);
        for (int pair = 0; pair < pairs; pair++) step_products(&t, pair, pairs);
        _tile_stored(0, w->o + c0 * 16, d * 4);
        _tile_stored(1, w->o + (c0 + 1) * 16, d * 4);
        if (heads == 2) {
            _tile_stored(2, w->o + head_o + c0 * 16, d * 4);
            _tile_stored(3, w->o + head_o + (c0 + 1) * 16, d * 4);
        }
    }
    for (int a = 0; a < heads; a++)
        for (int r = 0; r < rows; r++) {
            /* A multiply: a divide per value cost 0.1 ms a layer at 512 tokens. */
            const __m512 inverse = _mm512_set1_ps(1.0f / sums[a][r]);
            const float *o = w->o + a * head_o + r * d;
            uint16_t *dst = out + (int64_t)(q0 + r) * out_stride + (int64_t)(h + a) * d;
            for (int c = 0; c < d; c += 16)
                _mm256_storeu_si256((__m256i *)(dst + c),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + c), inverse)));
        }
}

#define BLOCK_ROWS 32 /* two query heads' 16 rows */
#else
/* Without AMX (AMD's Zen 4): AVX512-BF16 register tiles of TILE_ROWS query rows by TILE_COLS blocks of
 * 16 columns (keys for the scores, head dims for P V), the packed keys and values read as the B tiles
 * above would be: one 64-byte line per pair step and column block, times each row's broadcast pair.
 * Every score and output sums its pairs in order, so a row's bits are its own, as above (not AMX's:
 * its tile unit adds in another order). A block is BLOCK_POSITIONS query positions of every query head
 * sharing the KV head, so each packed line loaded feeds all of them. */
#define TILE_ROWS 6
#define TILE_COLS 4
#define BLOCK_POSITIONS 12

/* out[r][c * 16 ..] = sum over pairs t * 16 + u, t < blocks, of pair (r, t * 16 + u) of a times line
 * b + t * b_block + c * b_col + u * 16 (32-bit words). */
static inline __attribute__((always_inline)) void
tile_products(const uint32_t *a, int64_t a_row, const uint32_t *b, int64_t b_block, int64_t b_col, int blocks,
              float *out, int64_t out_row, const int rows, const int cols) {
    __m512 acc[TILE_ROWS][TILE_COLS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) acc[r][c] = _mm512_setzero_ps();
    for (int t = 0; t < blocks; t++)
        for (int u = 0; u < 16; u++) {
            __m512bh line[TILE_COLS];
            for (int c = 0; c < cols; c++)
                line[c] = (__m512bh)_mm512_load_si512(b + t * b_block + c * b_col + u * 16);
            for (int r = 0; r < rows; r++) {
                const __m512bh pair = (__m512bh)_mm512_set1_epi32((int)a[r * a_row + t * 16 + u]);
                for (int c = 0; c < cols; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], line[c], pair);
            }
        }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) _mm512_storeu_ps(out + r * out_row + c * 16, acc[r][c]);
}

#define TILE_CASE(r, c) \
    case (r) * 8 + (c): tile_products(a_at, a_row, b_at, b_block, b_col, blocks, out_at, out_row, r, c); break;
#define TILE_CASES(r) TILE_CASE(r, 1) TILE_CASE(r, 2) TILE_CASE(r, 3) TILE_CASE(r, 4)

/* rows x columns of products, in register tiles: rows of a pairs apart; column blocks b_col words apart. */
static void products(const uint32_t *a, int64_t a_row, const uint32_t *b, int64_t b_block, int64_t b_col, int blocks,
                     float *out, int64_t out_row, int rows, int col_blocks) {
    for (int r0 = 0; r0 < rows; r0 += TILE_ROWS)
        for (int c0 = 0; c0 < col_blocks; c0 += TILE_COLS) {
            const int r = rows - r0 < TILE_ROWS ? rows - r0 : TILE_ROWS;
            const int c = col_blocks - c0 < TILE_COLS ? col_blocks - c0 : TILE_COLS;
            const uint32_t *a_at = a + r0 * a_row;
            const uint32_t *b_at = b + c0 * b_col;
            float *out_at = out + r0 * out_row + c0 * 16;
            switch (r * 8 + c) { TILE_CASES(1) TILE_CASES(2) TILE_CASES(3) TILE_CASES(4) TILE_CASES(5) TILE_CASES(6) }
        }
}

/* One block of up to BLOCK_POSITIONS query positions (q0 ..) of the `heads` query heads from h, which share
 * the packed keys and values: row a * positions + r is head h + a at position q0 + r. */
static void attend_rows(const Rows *q, uint16_t *out, int64_t out_stride, int h, int heads, int q0, int positions,
                        int lq, int lk, int d, float scale, Scratch *w) {
    const int steps = d / 32, chunks = d / 16, offset = lk - lq, rows = heads * positions;
    const int keys = q0 + positions + offset < lk ? q0 + positions + offset : lk; /* the block's last row sees these */
    const int groups = (keys + 15) / 16, pairs = (keys + 31) / 32;
    for (int a = 0; a < heads; a++)
        for (int r = 0; r < positions; r++) memcpy(w->q + (a * positions + r) * d, row_at(q, q0 + r, h + a, d), (size_t)d * 2);
    /* Scores: key group g's pair P at kp + (g * steps * 16 + P) * 16 words (pack_keys). */
    products((const uint32_t *)w->q, d / 2, w->kp, 256, (int64_t)steps * 256, steps, w->s, w->width, rows, groups);
    float sums[TILE_ROWS * 8 * BLOCK_POSITIONS];
    for (int i = 0; i < rows; i++) {
        const int r = i % positions, visible = q0 + r + offset + 1 < lk ? q0 + r + offset + 1 : lk;
        sums[i] = softmax_row(w->s + (int64_t)i * w->width, w->p + (int64_t)i * w->width, visible, pairs * 32, scale);
    }
    /* P V: key pair t * 16 + u of head-dim chunk c at vp + ((t * chunks + c) * 16 + u) * 16 words (pack_values). */
    products((const uint32_t *)w->p, w->width / 2, w->vp, (int64_t)chunks * 256, 256, pairs, w->o, d, rows, chunks);
    for (int i = 0; i < rows; i++) {
        const __m512 inverse = _mm512_set1_ps(1.0f / sums[i]);
        const float *o = w->o + (int64_t)i * d;
        uint16_t *dst = out + (int64_t)(q0 + i % positions) * out_stride + (int64_t)(h + i / positions) * d;
        for (int c = 0; c < d; c += 16)
            _mm256_storeu_si256((__m256i *)(dst + c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + c), inverse)));
    }
}
#endif

/* q: query row i of head h at q + i * q_stride + h * d. Keys and values: row j of KV head g at
 * k + j * k_stride + g * d (v alike), or, where slots is not NULL, at k + (g * num_slots + slots[j]) * d
 * (the caches, head-major). out: row i of head h at out + i * out_stride + h * d. d a multiple of 32,
 * heads a multiple of kv_heads, 1 <= lq <= lk. Returns 0; -1 for a shape it does not take; -2 out
 * of memory; -3 for a slot outside the caches (nothing read). */
int prefill_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride, const uint16_t *v,
                      int64_t v_stride, const int64_t *slots, int64_t num_slots, uint16_t *out, int64_t out_stride,
                      int lq, int lk, int heads, int kv_heads, int d, float scale) {
    if (d % 32 || d <= 0 || kv_heads <= 0 || heads % kv_heads || lq < 1 || lk < lq) return -1;
    if (slots)
        for (int j = 0; j < lk; j++)
            if (slots[j] < 0 || slots[j] >= num_slots) return -3;
    const Rows qr = {q, q_stride, NULL, 0}, kr = {k, k_stride, slots, num_slots}, vr = {v, v_stride, slots, num_slots};
    const int group = heads / kv_heads;
    int status = 0;
#pragma omp parallel
    {
        Scratch w = {0};
#ifdef PREFILL_AMX
        const int ready = scratch_alloc(&w, lk, d, BLOCK_ROWS) == 0;
        /* Every tile 16 rows of 64 bytes. 0-3: results (16 float32 columns each), by A tile and B
         * tile; 4-5: A tiles, one per query head (16 query rows, or their weights, by 32 bf16); 6-7:
         * B tiles (16 pairs by 16 columns: keys, or head dims of values). */
        if (ready) configure(16, 16);
#else
        const int ready = group <= TILE_ROWS * 8 && scratch_alloc(&w, lk, d, group * BLOCK_POSITIONS) == 0;
#endif
#pragma omp for schedule(static)
        for (int g = 0; g < kv_heads; g++) {
            if (!ready) { /* every thread still takes its share of the loop, or the others wait forever */
#pragma omp atomic write
                status = -2;
                continue;
            }
            pack_keys(&kr, g, lk, d, w.kp);
            pack_values(&vr, g, lk, d, w.vp);
#ifndef PREFILL_AMX
            for (int q0 = 0; q0 < lq; q0 += BLOCK_POSITIONS)
                attend_rows(&qr, out, out_stride, g * group, group, q0,
                            lq - q0 < BLOCK_POSITIONS ? lq - q0 : BLOCK_POSITIONS, lq, lk, d, scale, &w);
#else
            for (int h = g * group; h < (g + 1) * group; h += 2)
                for (int q0 = 0; q0 < lq; q0 += 16) {
                    const int rows = lq - q0 < 16 ? lq - q0 : 16;
                    if (h + 1 < (g + 1) * group)
                        attend_block(&qr, out, out_stride, h, 2, q0, rows, lq, lk, d, scale, &w);
                    else
                        attend_block(&qr, out, out_stride, h, 1, q0, rows, lq, lk, d, scale, &w);
                }
#endif
        }
#ifdef PREFILL_AMX
        if (ready) _tile_release();
#endif
        scratch_free(&w);
    }
    return status;
}

#else

int prefill_attention_supported(void) { return 0; }

int prefill_attention(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride, const uint16_t *v,
                      int64_t v_stride, const int64_t *slots, int64_t num_slots, uint16_t *out, int64_t out_stride,
                      int lq, int lk, int heads, int kv_heads, int d, float scale) {
    (void)q, (void)q_stride, (void)k, (void)k_stride, (void)v, (void)v_stride, (void)slots, (void)num_slots;
    (void)out, (void)out_stride, (void)lq, (void)lk, (void)heads, (void)kv_heads, (void)d, (void)scale;
    return -1;
}

#endif
