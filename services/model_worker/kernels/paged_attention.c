/* Decode attention over a paged KV cache on the CPU: one call per layer for the whole batch.
 *
 * Sequence b has one query row (its newest token, at position context_lens[b] - 1), which attends
 * to all context_lens[b] positions; position p of b sits in cache slot
 * block_tables[b][p / block_size] * block_size + p % block_size. The cache is head-major,
 * (num_kv_heads, num_slots, head_dim), so a block's keys for one head are contiguous.
 *
 * A work item is one (sequence, KV head) pair: the query heads that share a KV head read each
 * key and value once, straight from the cache (nothing is gathered or padded), with a running
 * (online) softmax in float32. Each item's arithmetic depends only on its own query and context,
 * so a sequence gets the same result whatever else is in the batch.
 *
 * bf16 caches with AVX512-BF16 take a leaner path (about 0.8x the time at context 2048): scores by
 * vdpbf16ps on the raw bf16 query, sixteen of them reduced in one shuffle tree, and values split
 * into float32 with a shift or a mask instead of a widening convert. The arithmetic stays float32.
 * It reads each key and its value in one pass, SUB keys a softmax step (chunk_bf16).
 *
 * 8-bit caches (fp8 e4m3 with a scale per layer, int8 with a scale per row: kv8.h, docs/kv-cache.md) take
 * paths of their own in the same one-pass shape, rows read by stride where a chunk's blocks are one run. With
 * a bf16 query: int8 by integer products (chunk_q8i, AVX512-VNNI: rows sign-extended to int16 against the
 * query and the softmax weights rounded to int16), fp8 widened to bf16 by byte-table lookups and scored by
 * vdpbf16ps (chunk_q8b, AVX512-BF16 + VBMI). Otherwise (a float32 query, other CPUs, other shapes) each row
 * is widened to float32 in registers (chunk_q8). Scores are reduced sixteen at a time; fp8's scale goes on
 * the scores and the output, int8's on each key's score and each value's weight. write_kv_quant quantizes
 * rows as it writes them.
 */
#include <math.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kv8.h"

#ifdef __AVX512F__
#include <immintrin.h>
#define LANES 16
#else
#define LANES 1
#endif

/* Keys whose rows are looked up together; on the float32 path, the keys scored before each softmax
 * update. Longer chunks mean fewer updates and rescales; at context 2048 in bf16 (before the bf16 path
 * took its own steps), 256 keys took 0.86x the time of 64 (their scores still fit in L1). */
#define KEY_CHUNK 256
/* The bf16 path's keys per online-softmax step, and the key and value rows it fetches ahead (chunk_bf16). */
#define SUB 16
#define AHEAD 8
/* Rows of the next chunk looked up with each chunk: the float32 path prefetches its first PREFETCH keys
 * (defined below as 16), the bf16 path reads AHEAD on. */
#define NEXT_ROWS 16
/* Where a chunk's value rows start in Scratch.keys: after its key rows and the next chunk's first ones. */
#define VALUES_AT (KEY_CHUNK + NEXT_ROWS)

/* What a row's elements are (load1, load16): float32, bf16, or an 8-bit cache's fp8 (read as 2^-8 times its
 * value, as widen8x16 gives it) or int8 (its row's scale not applied). */
#define ELEM_F32 0
#define ELEM_BF16 1
#define ELEM_FP8 2
#define ELEM_INT8 3

static inline float load1(const void *row, int kind, int i) {
    if (kind >= ELEM_FP8) return widen8((const uint8_t *)row, i, kind == ELEM_FP8);
    return kind ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

#ifdef __AVX512F__
static inline __m512 load16(const void *row, int kind, int i) {
    if (kind >= ELEM_FP8) return widen8x16((const uint8_t *)row + i, kind == ELEM_FP8);
    if (!kind) return _mm512_loadu_ps((const float *)row + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* e^x for x <= 0 (scores minus their maximum), to about 2 ulp: 2^(x log2 e) split into an
 * integer power, applied exactly with scalef, and a polynomial on the remainder. */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f)); /* below this e^x is 0 in float32 */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif

#define PREFETCH 16 /* key rows ahead */
/* The 8-bit paths' rows fetched ahead (chunk_q8b, chunk_q8i; by stride only where paged_attention_prefetch_runs
 * says): their rows are half the bf16 path's bytes. */
#ifndef Q8_AHEAD
#define Q8_AHEAD 16
#endif
#if PREFETCH > NEXT_ROWS || AHEAD > NEXT_ROWS || Q8_AHEAD > NEXT_ROWS
#error "NEXT_ROWS must cover PREFETCH and AHEAD"
#endif

static inline void prefetch_row(const void *row, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)row + off, 0, 3);
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    void *out;
    const int32_t *context_lens, *block_tables;
    int64_t num_slots;
    int num_heads, num_kv_heads, head_dim, block_size, max_blocks, is_bf16;
    float scale;
    /* kv_kind: KV_SAME (the caches hold q's dtype), KV_FP8 (k_scale, v_scale: (1,)) or KV_INT8 (k_scale,
     * v_scale: (num_kv_heads, num_slots), a scale per cached row); elem: the caches' ELEM_ kind. */
    int kv_kind, elem;
    const float *k_scale, *v_scale;
    const uint8_t *tables; /* an 8-bit cache's byte tables (kv8_byte_tables), or NULL where there are none */
    int prefetch_runs;     /* fetch rows AHEAD on where a chunk's rows are one run (paged_attention_prefetch_runs) */
} Args;

typedef struct {
    float *q, *acc, *scores;  /* (group, head_dim), (group, head_dim), (group, KEY_CHUNK) */
    const char **keys;        /* the chunk's key rows, then at VALUES_AT its value rows */
    float *k_scales, *v_scales; /* an int8 cache: the chunk's keys' and values' scales (KEY_CHUNK) */
} Scratch;

/* Bytes of one cache element. */
static inline size_t elem_bytes(int elem) { return elem >= ELEM_FP8 ? 1 : elem == ELEM_BF16 ? 2 : 4; }

/* scores[r][j] = q[r] . key[j] for the chunk's n keys, and acc[r] += sum_j p[r][j] * value[j].
 * G, the query heads per KV head, is a constant in each specialisation below, so the loops over
 * rows unroll and every key or value slice is converted once for all G rows. */
static inline __attribute__((always_inline)) void score_chunk_g(const Args *a, const Scratch *w, const int G,
                                                                int n) {
    const int D = a->head_dim, vec_end = D / LANES * LANES;
    const size_t row_bytes = (size_t)D * elem_bytes(a->elem);
    for (int j = 0; j < n; j++) {
        const void *key = w->keys[j];
        /* The hardware prefetcher does not run far enough ahead through rows picked by a block
         * table: fetch the key PREFETCH rows on, and this key's value row for the pass after. */
        if (j + PREFETCH < n) prefetch_row(w->keys[j + PREFETCH], row_bytes);
        prefetch_row(w->keys[VALUES_AT + j], row_bytes);
        float s[G];
        for (int r = 0; r < G; r++) s[r] = 0.0f;
        int d = 0;
#ifdef __AVX512F__
        __m512 acc[G];
        for (int r = 0; r < G; r++) acc[r] = _mm512_setzero_ps();
        for (; d < vec_end; d += 16) {
            const __m512 k = load16(key, a->elem, d);
            for (int r = 0; r < G; r++) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(w->q + (size_t)r * D + d), k, acc[r]);
        }
        for (int r = 0; r < G; r++) s[r] = _mm512_reduce_add_ps(acc[r]);
#endif
        for (; d < D; d++) {
            const float k = load1(key, a->elem, d);
            for (int r = 0; r < G; r++) s[r] += w->q[(size_t)r * D + d] * k;
        }
        for (int r = 0; r < G; r++) w->scores[(size_t)r * KEY_CHUNK + j] = s[r];
    }
}

static inline __attribute__((always_inline)) void accumulate_values_g(const Args *a, const Scratch *w,
                                                                      const int G, int n) {
    const int D = a->head_dim, vec_end = D / LANES * LANES;
    const char **values = w->keys + VALUES_AT;
    int d = 0;
#ifdef __AVX512F__
    for (; d < vec_end; d += 16) {
        __m512 sum[G];
        for (int r = 0; r < G; r++) sum[r] = _mm512_loadu_ps(w->acc + (size_t)r * D + d);
        for (int j = 0; j < n; j++) {
            const __m512 v = load16(values[j], a->elem, d);
            for (int r = 0; r < G; r++)
                sum[r] = _mm512_fmadd_ps(_mm512_set1_ps(w->scores[(size_t)r * KEY_CHUNK + j]), v, sum[r]);
        }
        for (int r = 0; r < G; r++) _mm512_storeu_ps(w->acc + (size_t)r * D + d, sum[r]);
    }
#endif
    for (; d < D; d++)
        for (int j = 0; j < n; j++) {
            const float v = load1(values[j], a->elem, d);
            for (int r = 0; r < G; r++) w->acc[(size_t)r * D + d] += w->scores[(size_t)r * KEY_CHUNK + j] * v;
        }
}

/* The group sizes of real checkpoints get unrolled code; others run the same code one row at a time. */
#define FOR_GROUP(fn, a, w, group, n)                                                                    \
    switch (group) {                                                                                     \
    case 1: fn(a, w, 1, n); break;                                                                       \
    case 2: fn(a, w, 2, n); break;                                                                       \
    case 4: fn(a, w, 4, n); break;                                                                       \
    case 8: fn(a, w, 8, n); break;                                                                       \
    default:                                                                                             \
        for (int r = 0; r < (group); r++) {                                                              \
            Scratch row = {(w)->q + (size_t)r * (a)->head_dim, (w)->acc + (size_t)r * (a)->head_dim,    \
                           (w)->scores + (size_t)r * KEY_CHUNK, (w)->keys, (w)->k_scales, (w)->v_scales}; \
            fn(a, &row, 1, n);                                                                           \
        }                                                                                                \
    }

#ifdef __AVX512F__
/* Lane i of the result is the sum of v[i]'s sixteen lanes: a transposing tree of 45 shuffles and
 * adds, where sixteen separate reductions take about 150 instructions. */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 s[8], t[4], u[2];
    for (int i = 0; i < 8; i++)
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        t[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
}

/* Eight vectors of two keys' sums each (lanes 0-7 and 8-15): lane 2 i of the result is the sum of v[i]'s low
 * eight lanes, lane 2 i + 1 of its high eight, in 21 shuffles and adds and a permute (sum16's tree less a level). */
static inline __m512 sum8x2(const __m512 v[8]) {
    __m512 s[4], t[2];
    for (int i = 0; i < 4; i++)
        s[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        t[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], 0xEE));
    /* lanes 0-3: v[0..3]'s low sums, 4-7 their high sums, 8-11 and 12-15 v[4..7]'s */
    const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88), _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15), u);
}

/* Row r's step of the online softmax: scores[r] become exp(score - running max) (0 past the step's keys),
 * max and sum move on, and the factor that rescales what acc holds so far is returned (1 where the max
 * stayed, 0 on the first step). max_ps returns its second operand when the first is NaN: a NaN score is
 * skipped in the max, as in softmax_update. */
static inline float softmax_step(float *scores, int m, float *max, float *sum) {
    const __m512 s = _mm512_loadu_ps(scores);
    const float step_max = _mm512_reduce_max_ps(_mm512_max_ps(s, _mm512_set1_ps(-INFINITY)));
    float correction = 1.0f;
    if (step_max > *max) {
        correction = expf(*max - step_max); /* 0 on the first step: *max is -inf */
        *max = step_max;
    }
    const __m512 e = _mm512_maskz_mov_ps((__mmask16)((1u << m) - 1),
                                         exp16(_mm512_sub_ps(s, _mm512_set1_ps(*max))));
    _mm512_storeu_ps(scores, e);
    *sum = *sum * correction + _mm512_reduce_add_ps(e);
    return correction;
}

/* Row r's step of the online softmax on its scores in a register (lanes past the step's live keys not read): the
 * weights exp(score - running max), 0 past the live keys; max and sum move on; *correction rescales what acc
 * holds (1 where the max stayed, 0 on the first step). A NaN score is skipped in the max, as in softmax_step. */
static inline __m512 softmax_step_v(__m512 s, __mmask16 live, float *max, float *sum, float *correction) {
    s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, s);
    const float step_max = _mm512_reduce_max_ps(_mm512_max_ps(s, _mm512_set1_ps(-INFINITY)));
    float c = 1.0f;
    if (step_max > *max) {
        c = expf(*max - step_max); /* 0 on the first step: *max is -inf */
        *max = step_max;
    }
    const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s, _mm512_set1_ps(*max))));
    *sum = *sum * c + _mm512_reduce_add_ps(e);
    *correction = c;
    return e;
}

/* A step's scores a row: pass p's sums (sv[p], lane r KB + i for key p KB + i of row r, KB = 16 / G) regrouped
 * so that rows[r] lane j is key j of row r, in registers (a G x G transpose of KB-lane blocks). */
static inline __attribute__((always_inline)) void step_rows(const __m512 *sv, const int G, __m512 *rows) {
    if (G == 1) {
        rows[0] = sv[0];
    } else if (G == 2) {
        rows[0] = _mm512_shuffle_f32x4(sv[0], sv[1], 0x44);
        rows[1] = _mm512_shuffle_f32x4(sv[0], sv[1], 0xEE);
    } else if (G == 4) {
        const __m512 t0 = _mm512_shuffle_f32x4(sv[0], sv[1], 0x44), t1 = _mm512_shuffle_f32x4(sv[2], sv[3], 0x44);
        const __m512 t2 = _mm512_shuffle_f32x4(sv[0], sv[1], 0xEE), t3 = _mm512_shuffle_f32x4(sv[2], sv[3], 0xEE);
        rows[0] = _mm512_shuffle_f32x4(t0, t1, 0x88);
        rows[1] = _mm512_shuffle_f32x4(t0, t1, 0xDD);
        rows[2] = _mm512_shuffle_f32x4(t2, t3, 0x88);
        rows[3] = _mm512_shuffle_f32x4(t2, t3, 0xDD);
    } else { /* G 8: pairs of lanes, an 8 x 8 transpose of 64-bit elements through memory */
        double in[8][8] __attribute__((aligned(64))), out[8][8] __attribute__((aligned(64)));
        for (int p = 0; p < 8; p++) _mm512_store_pd(in[p], _mm512_castps_pd(sv[p]));
        for (int r = 0; r < 8; r++)
            for (int p = 0; p < 8; p++) out[r][p] = in[p][r];
        for (int r = 0; r < 8; r++) rows[r] = _mm512_castpd_ps(_mm512_load_pd(out[r]));
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define BF16_PATH 1
/* A key or value row's bytes on the bf16 path. */
#define ROW_BYTES(C, HALF) ((HALF) ? (size_t)32 : (size_t)(C) * 64)

/* The bf16 path reads each key and its value in one pass, SUB keys at a time: their scores, the online
 * softmax's update and the values' products. Keys in one pass and values in a second (the float32 path's
 * order) left the memory idle through each chunk's softmax: 28 layers of 16 sequences at a 420-token
 * context streamed the cache at 10.8 GB/s on one core of a Xeon with AMX, which reads two streams of rows
 * at 15-20 GB/s; in one pass, 13.1 GB/s (0.83x the time; 0.76x for one sequence at 2,048 tokens).
 * Fetching 16 or 32 rows ahead, or the next chunk's keys during the value pass, took longer.
 *
 * Both rows AHEAD on are fetched while the keys are scored, and none while the values are summed: against
 * each stream fetched in its own pass (the values' while they were summed), 28 layers of 16 sequences at
 * 175-525 tokens took 0.92-0.95x the time on one core of a Xeon with AMX (a C loop over the engine's cache
 * layout, on huge pages), 0.91-0.96x at 1 x 2,048, 4 x 100-300, 8 x 256-768, 64 x 50-150 and
 * 16 x 500-1,500, and the engine's 16-sequence decode step 0.976x. The keys fetched while the step before
 * sums its values (the values while scoring) did no better; the values a whole step (16 rows) ahead, or
 * 4, 6 or 12 rows ahead, no better or worse (docs/served-speed.md, item 41). */

/* rows[r] lane i = scale * (q[r] . key[i]) for the step's m <= SUB keys, by vdpbf16ps on the unscaled bf16
 * query (products of two bf16 are exact in float32); lanes past m are not keys. 16 / G keys at a time for all
 * G rows, so each key row is loaded once and the 16 (row, key) sums reduce together, lane r * KB + i,
 * regrouped into a vector a row in registers (step_rows) for the softmax step. Head size 16 by stride: two
 * keys a vector against the query in both halves, one 64-byte load a pair and half the sums to reduce
 * (sum8x2): 0.90-0.93x the kernel's time at 256 contexts of 16-150 tokens (bench_decode_attention, bit-equal);
 * rows looked up keep one key a vector, where pairing them (two loads and an insert) took 1.12x.
 * G and C (head_dim / 32) are constants at each call site, and a short group repeats its first key (its
 * sums unused), so the loops unroll and the 16 sums stay in registers: with the head size a runtime
 * value they went through memory, and this step took most of the kernel's time with the rows in cache. */
static inline __attribute__((always_inline)) void score_step_bf16(const Args *a, const char *const *keys,
                                                                   const char *run, const char *v_run,
                                                                   const __m512i *qb,
                                                                   const int G, const int C, const int HALF,
                                                                   const int FETCH, int m, __m512 *rows,
                                                                   int avail) {
    const int KB = 16 / G;
    const __m512 scale = _mm512_set1_ps(a->scale);
    __m512 sv[8];
    for (int p = 0; p < G; p++) sv[p] = _mm512_setzero_ps(); /* passes past the step's keys: masked below */
    for (int j0 = 0; j0 < m; j0 += KB) {
        const int k = m - j0 < KB ? m - j0 : KB;
        if (HALF && run) { /* two keys a vector, one load where rows are by stride */
            __m512 acc[8];
            for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
            for (int t = 0; t < KB / 2; t++) {
                const int at = j0 + (2 * t < k ? 2 * t : 0), pair = 2 * t + 1 < k;
                for (int i = 2 * t; FETCH && i < 2 * t + 2 && i < k && j0 + i + AHEAD < avail; i++) {
                    const size_t ahead = (size_t)(j0 + i + AHEAD) * 32;
                    prefetch_row(run + ahead, 32);
                    prefetch_row(v_run + ahead, 32);
                }
                const __m512i kv = pair ? _mm512_loadu_si512(run + (size_t)at * 32)
                                        : _mm512_maskz_loadu_epi16(0xFFFF, run + (size_t)at * 32);
                for (int r = 0; r < G; r++)
                    acc[r * (KB / 2) + t] = _mm512_dpbf16_ps(acc[r * (KB / 2) + t], (__m512bh)qb[r], (__m512bh)kv);
            }
            sv[j0 / KB] = _mm512_mul_ps(sum8x2(acc), scale);
            continue;
        }
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        for (int i = 0; i < KB; i++) {
            const int at = j0 + (i < k ? i : 0);
            const uint16_t *key = (const uint16_t *)(run ? run + (size_t)at * ROW_BYTES(C, HALF) : keys[at]);
            if (FETCH && i < k && j0 + i + AHEAD < avail) { /* the key and value rows AHEAD on: see above */
                const size_t ahead = (size_t)(j0 + i + AHEAD) * ROW_BYTES(C, HALF);
                prefetch_row(run ? run + ahead : keys[j0 + i + AHEAD], ROW_BYTES(C, HALF));
                prefetch_row(run ? v_run + ahead : keys[VALUES_AT + j0 + i + AHEAD], ROW_BYTES(C, HALF));
            }
            for (int c = 0; c < C; c++) { /* HALF: a row zero-extended, the query's upper copy unused */
                const __m512bh kv = (__m512bh)(HALF ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)key))
                                                    : _mm512_loadu_si512(key + 32 * c));
                for (int r = 0; r < G; r++)
                    acc[r * KB + i] = _mm512_dpbf16_ps(acc[r * KB + i], (__m512bh)qb[r * C + c], kv);
            }
        }
        sv[j0 / KB] = _mm512_mul_ps(sum16(acc), scale);
    }
    step_rows(sv, G, rows);
}

/* acc[r] = acc[r] * correction[r] + sum_j p[r][j] * value[j] over the step's m values. 32 bf16 dimensions
 * split into their even and odd ones as float32 with one shift and one mask, so acc holds each
 * 32-dimension chunk as its 16 even dimensions, then its 16 odd ones (acc_index). CB chunks a pass keep
 * the 2 G CB sums in registers while each value row is read. */
static inline __attribute__((always_inline)) void accumulate_step_bf16(const Args *a, float *acc,
                                                                        const char *const *values, const char *run,
                                                                        const int G, const int C, const int HALF, int m,
                                                                        float p_rows[][SUB], const float *correction) {
    if (HALF) { /* 16 dimensions: one widening shift a value row, acc in order */
        __m512 sums[8];
        for (int r = 0; r < G; r++) sums[r] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * r), _mm512_set1_ps(correction[r]));
        for (int j = 0; j < m; j++) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(run ? run + (size_t)j * 32 : values[j]));
            const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            for (int r = 0; r < G; r++) sums[r] = _mm512_fmadd_ps(_mm512_set1_ps(p_rows[r][j]), v, sums[r]);
        }
        for (int r = 0; r < G; r++) _mm512_storeu_ps(acc + 16 * r, sums[r]);
        return;
    }
    const int CB = G >= 8 ? 1 : 8 / G;
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int c0 = 0; c0 < C; c0 += CB) {
        const int cs = C - c0 < CB ? C - c0 : CB;
        __m512 even[16], odd[16];
        for (int r = 0; r < G; r++) {
            const __m512 f = _mm512_set1_ps(correction[r]);
            for (int c = 0; c < cs; c++) {
                even[r * CB + c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)r * a->head_dim + 32 * (c0 + c)), f);
                odd[r * CB + c] = _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)r * a->head_dim + 32 * (c0 + c) + 16), f);
            }
        }
        for (int j = 0; j < m; j++) {
            __m512 p[8];
            for (int r = 0; r < G; r++) p[r] = _mm512_set1_ps(p_rows[r][j]);
            for (int c = 0; c < cs; c++) {
                const char *row = run ? run + (size_t)j * ROW_BYTES(C, HALF) : values[j];
                const __m512i v = _mm512_loadu_si512((const uint16_t *)row + 32 * (c0 + c));
                const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(v, high));
                for (int r = 0; r < G; r++) {
                    even[r * CB + c] = _mm512_fmadd_ps(p[r], ve, even[r * CB + c]);
                    odd[r * CB + c] = _mm512_fmadd_ps(p[r], vo, odd[r * CB + c]);
                }
            }
        }
        for (int r = 0; r < G; r++)
            for (int c = 0; c < cs; c++) {
                _mm512_storeu_ps(acc + (size_t)r * a->head_dim + 32 * (c0 + c), even[r * CB + c]);
                _mm512_storeu_ps(acc + (size_t)r * a->head_dim + 32 * (c0 + c) + 16, odd[r * CB + c]);
            }
    }
}

/* How chunk_bf16 reads its rows (STRIDED): through w->keys, by stride from k_run and v_run fetching AHEAD on,
 * or by stride leaving the fetching to the hardware (paged_attention_prefetch_runs says which, per CPU). */
#define BY_POINTERS 0
#define STRIDED_FETCHED 1
#define STRIDED_UNFETCHED 2

/* A chunk of n keys on the bf16 path (w->keys: n key rows, then at VALUES_AT the value rows, each array
 * with `avail` >= n entries, those past n the next chunk's first rows), in steps of SUB keys. G query rows
 * a KV head, C = head_dim / 32, or C = 1 and HALF for head_dim 16 (rows zero-extended to 32 to be scored).
 * Where the chunk's slots are one run, k_run and v_run are its first key and value rows and w->keys is
 * not read: rows by stride, fetched AHEAD on or not as the CPU reads them faster. */
static inline __attribute__((always_inline)) void chunk_bf16(const Args *a, Scratch *w, const __m512i *qb,
                                                              const int G, const int C, const int HALF,
                                                              const int STRIDED, const char *k_run,
                                                              const char *v_run, int n, int avail, float *max,
                                                              float *sum) {
    const char *const *keys = w->keys, *const *values = w->keys + VALUES_AT;
    const size_t row_bytes = ROW_BYTES(C, HALF);
    float scores[8][SUB] __attribute__((aligned(64)));
    for (int j0 = 0; j0 < n; j0 += SUB) {
        const int m = n - j0 < SUB ? n - j0 : SUB;
        __m512 rows[8];
        score_step_bf16(a, keys + j0, STRIDED ? k_run + j0 * row_bytes : NULL,
                        STRIDED ? v_run + j0 * row_bytes : NULL, qb, G, C, HALF, STRIDED != STRIDED_UNFETCHED, m,
                        rows, avail - j0);
        float correction[8];
        for (int r = 0; r < G; r++)
            _mm512_store_ps(scores[r], softmax_step_v(rows[r], (__mmask16)((1u << m) - 1), &max[r], &sum[r],
                                                      &correction[r]));
        accumulate_step_bf16(a, w->acc, values + j0, STRIDED ? v_run + j0 * row_bytes : NULL, G, C, HALF, m,
                             scores, correction);
    }
}

/* chunk_bf16 with G and C constants: the group sizes 1, 2, 4, 8 by head sizes 16, 32, 64, 128 and 256 (those
 * of real checkpoints and the small test ones: with C a runtime value, head size 32 took 1.4x the time of its
 * own case at 20-150-token contexts); other head sizes with C a runtime value. */
#define CHUNK_BF16_C(G, S)                                                                               \
    switch (C) {                                                                                         \
    case 0: chunk_bf16(a, w, qb, G, 1, 1, S, k_run, v_run, n, avail, max, sum); break;                   \
    case 1: chunk_bf16(a, w, qb, G, 1, 0, S, k_run, v_run, n, avail, max, sum); break;                   \
    case 2: chunk_bf16(a, w, qb, G, 2, 0, S, k_run, v_run, n, avail, max, sum); break;                   \
    case 4: chunk_bf16(a, w, qb, G, 4, 0, S, k_run, v_run, n, avail, max, sum); break;                   \
    case 8: chunk_bf16(a, w, qb, G, 8, 0, S, k_run, v_run, n, avail, max, sum); break;                   \
    default: chunk_bf16(a, w, qb, G, C, 0, S, k_run, v_run, n, avail, max, sum);                         \
    }
#define CHUNK_BF16_G(S)                                                                                  \
    switch (group) {                                                                                     \
    case 1: CHUNK_BF16_C(1, S); break;                                                                   \
    case 2: CHUNK_BF16_C(2, S); break;                                                                   \
    case 4: CHUNK_BF16_C(4, S); break;                                                                   \
    case 8: CHUNK_BF16_C(8, S); break;                                                                   \
    }
/* C: head_dim / 32, or 0 for head_dim 16; k_run, v_run: the chunk's first rows where its slots are one run,
 * else NULL; fetch: whether a run's rows are fetched ahead (rows looked up always are). */
static void chunk_bf16_of(const Args *a, Scratch *w, const __m512i *qb, int group, int C, const char *k_run,
                          const char *v_run, int n, int avail, int fetch, float *max, float *sum) {
    if (!k_run) CHUNK_BF16_G(BY_POINTERS)
    else if (fetch) CHUNK_BF16_G(STRIDED_FETCHED)
    else CHUNK_BF16_G(STRIDED_UNFETCHED)
}
#endif

#ifdef __AVX512F__
#define Q8_PATH 1
/* An 8-bit cache's chunk of n keys (w->keys as chunk_bf16 takes them), in steps of SUB keys: scores, the
 * online softmax's step and the values' products in one pass, each row widened in registers (widen8x16)
 * and multiplied in float32. qf: the group's query rows in float32, already times the softmax scale (and
 * fp8's 2^8 k_scale); an int8 key's score is then times its row's scale, and an int8 value's weight times
 * its row's. Scores go 16 / G keys at a time for all G rows, reduced together (sum16), as the bf16 path's.
 * G and C (head_dim / 16) are constants at each call site. acc holds each row in order. */
static inline __attribute__((always_inline)) void chunk_q8(Scratch *w, const float *qf, const int G, const int C,
                                                            const int FP8, int n, int avail, float *max,
                                                            float *sum) {
    const char *const *keys = w->keys, *const *values = w->keys + VALUES_AT;
    const size_t row_bytes = (size_t)C * 16;
    const int KB = 16 / G, D = C * 16;
    const int CB = G >= 8 ? 2 : 16 / G; /* G CB value sums stay in registers */
    float scores[8][SUB] __attribute__((aligned(64)));
    for (int j0 = 0; j0 < n; j0 += SUB) {
        const int m = n - j0 < SUB ? n - j0 : SUB;
        for (int r = 0; r < G; r++) _mm512_storeu_ps(scores[r], _mm512_set1_ps(-INFINITY));
        for (int i0 = 0; i0 < m; i0 += KB) {
            const int k = m - i0 < KB ? m - i0 : KB;
            __m512 acc[16];
            for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
            for (int i = 0; i < KB; i++) {
                const int at = j0 + i0 + (i < k ? i : 0); /* a short group repeats its first key, sums unused */
                const uint8_t *key = (const uint8_t *)keys[at];
                if (i < k && at + AHEAD < avail) {
                    prefetch_row(keys[at + AHEAD], row_bytes);
                    prefetch_row(values[at + AHEAD], row_bytes);
                }
                for (int c = 0; c < C; c++) {
                    const __m512 kv = widen8x16(key + 16 * c, FP8);
                    for (int r = 0; r < G; r++)
                        acc[r * KB + i] = _mm512_fmadd_ps(_mm512_loadu_ps(qf + (size_t)r * D + 16 * c), kv,
                                                          acc[r * KB + i]);
                }
            }
            float s[16];
            _mm512_storeu_ps(s, sum16(acc));
            for (int r = 0; r < G; r++)
                for (int i = 0; i < k; i++)
                    scores[r][i0 + i] = FP8 ? s[r * KB + i] : s[r * KB + i] * w->k_scales[j0 + i0 + i];
        }
        float correction[8];
        for (int r = 0; r < G; r++) correction[r] = softmax_step(scores[r], m, &max[r], &sum[r]);
        if (!FP8)
            for (int r = 0; r < G; r++)
                for (int i = 0; i < m; i++) scores[r][i] *= w->v_scales[j0 + i];
        for (int c0 = 0; c0 < C; c0 += CB) {
            const int cs = C - c0 < CB ? C - c0 : CB;
            __m512 sums[16];
            for (int r = 0; r < G; r++)
                for (int c = 0; c < cs; c++)
                    sums[r * CB + c] = _mm512_mul_ps(_mm512_loadu_ps(w->acc + (size_t)r * D + 16 * (c0 + c)),
                                                     _mm512_set1_ps(correction[r]));
            for (int j = 0; j < m; j++) {
                const uint8_t *row = (const uint8_t *)values[j0 + j];
                __m512 p[8];
                for (int r = 0; r < G; r++) p[r] = _mm512_set1_ps(scores[r][j]);
                for (int c = 0; c < cs; c++) {
                    const __m512 v = widen8x16(row + 16 * (c0 + c), FP8);
                    for (int r = 0; r < G; r++) sums[r * CB + c] = _mm512_fmadd_ps(p[r], v, sums[r * CB + c]);
                }
            }
            for (int r = 0; r < G; r++)
                for (int c = 0; c < cs; c++) _mm512_storeu_ps(w->acc + (size_t)r * D + 16 * (c0 + c), sums[r * CB + c]);
        }
    }
}

#define CHUNK_Q8_C(G, F)                                                                                 \
    switch (C) {                                                                                         \
    case 1: chunk_q8(w, qf, G, 1, F, n, avail, max, sum); break;                                         \
    case 2: chunk_q8(w, qf, G, 2, F, n, avail, max, sum); break;                                         \
    case 4: chunk_q8(w, qf, G, 4, F, n, avail, max, sum); break;                                         \
    case 8: chunk_q8(w, qf, G, 8, F, n, avail, max, sum); break;                                         \
    case 16: chunk_q8(w, qf, G, 16, F, n, avail, max, sum); break;                                       \
    default: chunk_q8(w, qf, G, C, F, n, avail, max, sum);                                               \
    }
#define CHUNK_Q8_G(F)                                                                                    \
    switch (group) {                                                                                     \
    case 1: CHUNK_Q8_C(1, F); break;                                                                     \
    case 2: CHUNK_Q8_C(2, F); break;                                                                     \
    case 4: CHUNK_Q8_C(4, F); break;                                                                     \
    case 8: CHUNK_Q8_C(8, F); break;                                                                     \
    }
/* C: head_dim / 16; group 1, 2, 4 or 8. */
static void chunk_q8_of(Scratch *w, const float *qf, int group, int C, int fp8, int n, int avail, float *max,
                        float *sum) {
    if (fp8) CHUNK_Q8_G(1) else CHUNK_Q8_G(0)
}
#endif

#include "kv8_attention.h"

/* The register path a work item takes (attend chooses it once), with its query in that path's form. */
#define PATH_NONE 0
#define PATH_BF16 1 /* bf16 rows by vdpbf16ps: chunk_bf16 */
#define PATH_Q8I 2  /* int8 rows by vpdpwssd: chunk_q8i */
#define PATH_Q8B 3  /* 8-bit rows widened to bf16 by byte tables: chunk_q8b */
typedef struct {
    int kind, group;
    int C;              /* bf16: head_dim / 32, 0 for head_dim 16; q8i: head_dim / 32; q8b: head_dim / 64 */
#ifdef __AVX512F__
    const __m512i *qb;  /* bf16: the query rows as they are; q8b: in q8b_query's layout */
#endif
    const int16_t *q16; /* q8i: the query rows in int16 (q8i_query), and each row's score factor */
    const float *qf;
    float q8b_kf; /* q8b: the score factor (the softmax scale, fp8: times the layer's key scale) */
} RegPath;

/* n of a chunk's keys on p's path: by stride from k_run and v_run (slots in one run; an int8 cache's scales at
 * ks and vs), fetched ahead where Args.prefetch_runs says this CPU wants it; or, k_run NULL, looked up in w->keys
 * (avail >= n rows, the next chunk's first after them; ks and vs the chunk's scales) and fetched ahead. The one
 * place for the three ways attend reads a chunk: one run, run by run, and looked up. */
static inline __attribute__((always_inline)) void chunk_on_path(const Args *a, Scratch *w, const RegPath *p,
                                                                  const char *k_run, const char *v_run,
                                                                  const float *ks, const float *vs, int n, int avail,
                                                                  float *max, float *sum) {
    const int fetch = k_run ? a->prefetch_runs : 1;
    switch (p->kind) {
#ifdef BF16_PATH
    case PATH_BF16: chunk_bf16_of(a, w, p->qb, p->group, p->C, k_run, v_run, n, avail, fetch, max, sum); break;
#endif
#ifdef Q8I_PATH
    case PATH_Q8I:
        chunk_q8i_of(w, k_run, v_run, ks, vs, p->q16, p->qf, p->group, p->C, n, avail, fetch, max, sum);
        break;
#endif
#ifdef Q8B_PATH
    case PATH_Q8B:
        chunk_q8b_of(w, k_run, v_run, ks, vs, p->qb, a->tables, p->group, p->C, a->kv_kind == KV_FP8, p->q8b_kf, n,
                     avail, fetch, max, sum);
        break;
#endif
    }
    /* where this CPU has no register path, nothing above is built */
    (void)a, (void)w, (void)k_run, (void)v_run, (void)ks, (void)vs, (void)n, (void)avail, (void)max, (void)sum,
        (void)fetch;
}

/* Where dimension d sits in a row of acc: in place, or even/odd by 32-dimension chunk on the bf16 path. */
static inline int acc_index(int d, int bf16_path, int head_dim) {
    return bf16_path && head_dim % 32 == 0 ? (d & ~31) + (d & 1) * 16 + (d & 31) / 2 : d;
}

/* Turn row r's n scores into exp(score - running max), rescaling what came before if the max rose. */
static void softmax_update(const Args *a, const Scratch *w, int r, int n, float *max, float *sum) {
    float *s = w->scores + (size_t)r * KEY_CHUNK;
    float chunk_max = -INFINITY;
    int j = 0;
#ifdef __AVX512F__
    /* max_ps returns its second operand when the first is NaN: a NaN score is skipped, as below. */
    __m512 running = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16) running = _mm512_max_ps(_mm512_loadu_ps(s + j), running);
    chunk_max = _mm512_reduce_max_ps(running);
#endif
    for (; j < n; j++) chunk_max = s[j] > chunk_max ? s[j] : chunk_max;
    const float new_max = chunk_max > *max ? chunk_max : *max;
    const float correction = expf(*max - new_max); /* 0 on the first chunk: *max is -inf */
    float chunk_sum = 0.0f;
    j = 0;
#ifdef __AVX512F__
    __m512 m = _mm512_set1_ps(new_max), total = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
        _mm512_storeu_ps(s + j, e);
        total = _mm512_add_ps(total, e);
    }
    chunk_sum = _mm512_reduce_add_ps(total);
#endif
    for (; j < n; j++) {
        s[j] = expf(s[j] - new_max);
        chunk_sum += s[j];
    }
    *sum = *sum * correction + chunk_sum;
    *max = new_max;
    if (correction != 1.0f) {
        float *acc = w->acc + (size_t)r * a->head_dim;
        for (int d = 0; d < a->head_dim; d++) acc[d] *= correction;
    }
}

static void attend(const Args *a, Scratch *w, int b, int kvh) {
    const int D = a->head_dim, group = a->num_heads / a->num_kv_heads, ctx = a->context_lens[b];
    const int32_t *table = a->block_tables + (int64_t)b * a->max_blocks;
    const size_t q_row_bytes = (a->is_bf16 ? 2 : 4) * (size_t)D, row_bytes = elem_bytes(a->elem) * (size_t)D;
    const char *k_head = (const char *)a->k_cache + (size_t)kvh * a->num_slots * row_bytes;
    const char *v_head = (const char *)a->v_cache + (size_t)kvh * a->num_slots * row_bytes;
    const float *k_scales = a->kv_kind == KV_INT8 ? a->k_scale + (size_t)kvh * a->num_slots : NULL;
    const float *v_scales = a->kv_kind == KV_INT8 ? a->v_scale + (size_t)kvh * a->num_slots : NULL;
    /* fp8: the per-layer scales (and widen8x16's 2^8) go on the query and on the output, not on each row. */
    const float k_factor = a->kv_kind == KV_FP8 ? a->k_scale[0] * 256.0f : 1.0f;
    float v_factor = a->kv_kind == KV_FP8 ? a->v_scale[0] * 256.0f : 1.0f;
    float max[64], sum[64];
#ifdef Q8I_PATH
    const int q8i_path = a->kv_kind == KV_INT8 && a->is_bf16 && D % 32 == 0 && D <= 256 &&
                         (group == 1 || group == 2 || group == 4 || group == 8);
    float qf[8]; /* q8i: each row's score factor */
#else
    const int q8i_path = 0;
#endif
#ifdef Q8B_PATH
    const int q8b_path = !q8i_path && a->kv_kind != KV_SAME && a->is_bf16 && a->tables && D % 64 == 0 &&
                         D <= 256 && (group == 1 || group == 2 || group == 4 || group == 8);
    /* fp8 rows widened by the tables are exact: only the layer's scales remain to apply */
    const int q8b_ordered = q8b_path && !Q8B_TABLE_VALUES(a->kv_kind == KV_FP8, group);
    const float q8b_kf = a->scale * (a->kv_kind == KV_FP8 ? a->k_scale[0] : 1.0f);
    if (q8b_path && !q8b_ordered) v_factor = a->v_scale[0];
#else
    const int q8b_path = 0, q8b_ordered = 0;
#endif
#ifdef Q8_PATH
    const int q8_path = a->kv_kind != KV_SAME && D % 16 == 0 && D <= 256 &&
                        (group == 1 || group == 2 || group == 4 || group == 8);
#else
    const int q8_path = 0;
#endif
#ifdef BF16_PATH
    const int bf16_path = a->kv_kind == KV_SAME && a->is_bf16 && (D % 32 == 0 || D == 16) && group * (D / 32) <= 64 &&
                          (group == 1 || group == 2 || group == 4 || group == 8);
    const int half = D == 16; /* one 32-dimension chunk, zero-extended; acc in order */
    __m512i qb[8 * 8]; /* the group's query rows as they are, D / 32 vectors a row (one for D 16) */
#else
    const int bf16_path = 0;
#endif
#if defined(Q8B_PATH)
    __m512i *const qb8 = qb; /* q8b_query's layout: 2 D / 64 vectors a row */
#endif

    for (int r = 0; r < group; r++) {
        const char *row = (const char *)a->q + ((size_t)b * a->num_heads + (size_t)kvh * group + r) * q_row_bytes;
#ifdef BF16_PATH
        if (bf16_path && half) /* in both halves: two keys a vector (score_step_bf16) */
            qb[r] = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)row));
        else if (bf16_path)
            for (int c = 0; c < D / 32; c++) qb[r * (D / 32) + c] = _mm512_loadu_si512((const uint16_t *)row + 32 * c);
        else
#endif
#ifdef Q8I_PATH
        if (q8i_path)
            qf[r] = a->scale * q8i_query((const uint16_t *)row, D, (int16_t *)w->q + (size_t)r * D);
        else
#endif
#ifdef Q8B_PATH
        if (q8b_path)
            q8b_query((const uint16_t *)row, D, qb8 + (size_t)r * (D / 32));
        else
#endif
            for (int d = 0; d < D; d++) w->q[(size_t)r * D + d] = load1(row, a->is_bf16, d) * a->scale * k_factor;
        memset(w->acc + (size_t)r * D, 0, (size_t)D * 4);
        max[r] = -INFINITY;
        sum[r] = 0.0f;
    }
    RegPath path = {.kind = PATH_NONE, .group = group};
#ifdef BF16_PATH
    if (bf16_path) path = (RegPath){.kind = PATH_BF16, .group = group, .C = half ? 0 : D / 32, .qb = qb};
#endif
#ifdef Q8I_PATH
    if (q8i_path)
        path = (RegPath){.kind = PATH_Q8I, .group = group, .C = D / 32, .q16 = (const int16_t *)w->q, .qf = qf};
#endif
#ifdef Q8B_PATH
    if (q8b_path) path = (RegPath){.kind = PATH_Q8B, .group = group, .C = D / 64, .qb = qb8, .q8b_kf = q8b_kf};
#endif
    for (int k0 = 0; k0 < ctx; k0 += KEY_CHUNK) {
        const int n = ctx - k0 < KEY_CHUNK ? ctx - k0 : KEY_CHUNK;
        /* The chunk's rows and the next chunk's first NEXT_ROWS, for fetching ahead. */
        const int avail = ctx - k0 < n + NEXT_ROWS ? ctx - k0 : n + NEXT_ROWS;
#if defined(BF16_PATH) || defined(Q8I_PATH) || defined(Q8B_PATH)
        /* Where the blocks the chunk (and the rows after it) spans are one run of ids, its rows are read
         * by stride (and an int8 cache's scales in place): the block manager allocates runs where it can. */
        if (path.kind != PATH_NONE) {
            const int first_block = k0 / a->block_size, last_block = (k0 + avail - 1) / a->block_size;
            int run = 1;
            for (int i = first_block; i < last_block && run; i++) run = table[i + 1] == table[i] + 1;
            if (run) {
                const size_t first = (size_t)table[first_block] * a->block_size + k0 % a->block_size;
                const char *k_run = k_head + first * row_bytes, *v_run = v_head + first * row_bytes;
                const float *ks = k_scales ? k_scales + first : NULL, *vs = v_scales ? v_scales + first : NULL;
                if (ks) /* the next chunk's scales */
                    for (int i = 0; i < KEY_CHUNK; i += 16) {
                        __builtin_prefetch(ks + n + i, 0, 3);
                        __builtin_prefetch(vs + n + i, 0, 3);
                    }
                chunk_on_path(a, w, &path, k_run, v_run, ks, vs, n, avail, max, sum);
                continue;
            }
            /* Two or three runs (a shared prefix's blocks, then the sequence's own run, say): where the hardware's
             * prefetchers read strided rows (no fetching of the kernel's own is lost at a run's end) and blocks
             * hold a multiple of SUB keys (so each run starts on a step, and the steps are the ones rows
             * looked up take: the same bits), each run of the chunk's blocks is read by stride in turn, on every
             * path (bf16, int8, fp8). Blocks scattered one by one are looked up: read by stride a block at a time,
             * with nothing fetching the next block, 16 sequences at 100-600 tokens (head size 128) took 1.5-1.6x
             * the time. */
            int breaks = 0;
            const int last = (k0 + n - 1) / a->block_size;
            for (int i = first_block; i < last && breaks <= 2; i++) breaks += table[i + 1] != table[i] + 1;
            if (!a->prefetch_runs && a->block_size % SUB == 0 && breaks <= 2) {
                for (int j = 0; j < n;) {
                    const int pos = k0 + j;
                    int end_block = pos / a->block_size;
                    while (end_block < last && table[end_block + 1] == table[end_block] + 1) end_block++;
                    const int end = (end_block + 1) * a->block_size - k0 < n ? (end_block + 1) * a->block_size - k0 : n;
                    const size_t first = (size_t)table[pos / a->block_size] * a->block_size + pos % a->block_size;
                    const char *k_run = k_head + first * row_bytes, *v_run = v_head + first * row_bytes;
                    const float *ks = k_scales ? k_scales + first : NULL, *vs = v_scales ? v_scales + first : NULL;
                    chunk_on_path(a, w, &path, k_run, v_run, ks, vs, end - j, end - j, max, sum);
                    j = end;
                }
                continue;
            }
        }
#endif
        /* A block's slots are consecutive: one table lookup (and one division) per block, not per key. */
        for (int j = 0; j < avail;) {
            const int pos = k0 + j, offset = pos % a->block_size;
            const int run = a->block_size - offset < avail - j ? a->block_size - offset : avail - j;
            const size_t first = (size_t)table[pos / a->block_size] * a->block_size + offset;
            for (int t = 0; t < run; t++, j++) {
                w->keys[j] = k_head + (first + t) * row_bytes;
                w->keys[VALUES_AT + j] = v_head + (first + t) * row_bytes;
                if (k_scales && j < n) {
                    w->k_scales[j] = k_scales[first + t];
                    w->v_scales[j] = v_scales[first + t];
                }
            }
        }
        if (k_scales) /* the next chunk's scales, one line a block each, fetched while this chunk is read */
            for (int pos = k0 + n; pos < ctx && pos < k0 + n + KEY_CHUNK; pos += a->block_size - pos % a->block_size) {
                const size_t slot = (size_t)table[pos / a->block_size] * a->block_size + pos % a->block_size;
                __builtin_prefetch(k_scales + slot, 0, 3);
                __builtin_prefetch(v_scales + slot, 0, 3);
            }
        if (path.kind != PATH_NONE) {
            chunk_on_path(a, w, &path, NULL, NULL, w->k_scales, w->v_scales, n, avail, max, sum);
            continue;
        }
#ifdef Q8_PATH
        if (q8_path) {
            chunk_q8_of(w, w->q, group, D / 16, a->kv_kind == KV_FP8, n, avail, max, sum);
            continue;
        }
#endif
        /* The next chunk's first keys, which the loop below cannot reach ahead to. */
        for (int j = n; j < avail; j++) prefetch_row(w->keys[j], row_bytes);
        FOR_GROUP(score_chunk_g, a, w, group, n);
        if (k_scales) /* int8: each key's score times its row's scale, each value's weight times its own */
            for (int r = 0; r < group; r++)
                for (int j = 0; j < n; j++) w->scores[(size_t)r * KEY_CHUNK + j] *= w->k_scales[j];
        for (int r = 0; r < group; r++) softmax_update(a, w, r, n, &max[r], &sum[r]);
        if (v_scales)
            for (int r = 0; r < group; r++)
                for (int j = 0; j < n; j++) w->scores[(size_t)r * KEY_CHUNK + j] *= w->v_scales[j];
        FOR_GROUP(accumulate_values_g, a, w, group, n);
    }
    for (int r = 0; r < group; r++) {
        const size_t row = ((size_t)b * a->num_heads + (size_t)kvh * group + r) * D;
        const float inv = v_factor / sum[r], *acc = w->acc + (size_t)r * D;
#ifdef BF16_PATH
        if (bf16_path && half) {
            store_bf16((uint16_t *)a->out + row, round_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(acc), _mm512_set1_ps(inv))));
            continue;
        }
        if (bf16_path) { /* each 32-dimension chunk back in order, rounded as f32_to_bf16 does */
            for (int c = 0; c < D / 32; c++) {
                const __m512 even = _mm512_mul_ps(_mm512_loadu_ps(acc + 32 * c), _mm512_set1_ps(inv));
                const __m512 odd = _mm512_mul_ps(_mm512_loadu_ps(acc + 32 * c + 16), _mm512_set1_ps(inv));
                const __m512i pairs = _mm512_or_si512(_mm512_srli_epi32(round_bf16x16(even), 16), round_bf16x16(odd));
                _mm512_storeu_si512((uint16_t *)a->out + row + 32 * c, pairs);
            }
            continue;
        }
#endif
#if defined(Q8I_PATH) || defined(Q8B_PATH)
        if (q8i_path || q8b_path) { /* bf16 rows of a multiple of 32: back in order, rounded 16 at a time */
            float ordered[256] __attribute__((aligned(64)));
            for (int d = 0; d < D; d++) ordered[d] = acc[q8i_path ? q8i_acc_index(d) : q8b_ordered ? d : q8b_acc_index(d)];
            for (int d = 0; d < D; d += 16)
                store_bf16((uint16_t *)a->out + row + d,
                           round_bf16x16(_mm512_mul_ps(_mm512_load_ps(ordered + d), _mm512_set1_ps(inv))));
            continue;
        }
#endif
        for (int d = 0; d < D; d++) {
            const float x = acc[acc_index(d, bf16_path, D)] * inv;
            if (a->is_bf16) ((uint16_t *)a->out)[row + d] = f32_to_bf16(x);
            else ((float *)a->out)[row + d] = x;
        }
    }
}

/* Whether every block a sequence's context reaches is in its table row (0, else -4) and in the
 * pool (0, else -3). A bad entry would otherwise read outside the caches, as a bad slot would
 * write outside them in write_kv; one pass over the tables costs little beside the attention. */
static int check_block_tables(const int32_t *context_lens, const int32_t *block_tables, int64_t num_slots,
                              int num_seqs, int block_size, int max_blocks) {
    const int64_t num_blocks = num_slots / block_size;
    for (int b = 0; b < num_seqs; b++) {
        const int64_t used = ((int64_t)context_lens[b] + block_size - 1) / block_size;
        if (used > max_blocks) return -4;
        const int32_t *table = block_tables + (int64_t)b * max_blocks;
        for (int64_t j = 0; j < used; j++)
            if (table[j] < 0 || table[j] >= num_blocks) return -3;
    }
    return 0;
}

/* Whether the bf16 path fetches key and value rows AHEAD on (the 8-bit paths Q8_AHEAD on) where a chunk's rows
 * are one run of slots (read by stride), or leaves the two streams to the hardware's prefetchers. It depends on
 * the CPU. On AMD's family 25 (Zen 4), without the fetches, on one core (bench/bench_decode_attention.py,
 * bit-equal, in one run against the kernel with them): 16 sequences at 1,000 tokens, head size 128, took
 * 0.60-0.62x the time (25 GB/s, the core's streaming rate, against 15); 64 at 1,500-2,048 tokens 0.60x; one at
 * 2,048 0.78x; 256 short contexts 0.85-0.89x, 0.92x and 0.81-0.94x at head sizes 16, 32 and 128. The int8 path
 * there, 16 sequences at 1,024 tokens (8 KV heads of 128, the cache read from memory), took 0.84-0.85x the time
 * on one core and 0.69-0.83x on two; fp8's 0.95-0.97x on two. On family 26 the fetches were what made the
 * strided reads pay: 64 sequences at 1,500-2,048 tokens took 1.4x the time without them. Other CPUs keep them,
 * as measured when the strided reads came in. Family is CPUID's (base family, plus the extended family where it
 * is 15). */
static int prefetch_runs_of_cpu(void) {
#if defined(__x86_64__) || defined(__i386__)
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return 1;
    unsigned family = (eax >> 8) & 0xf;
    if (family == 0xf) family += (eax >> 20) & 0xff;
    char vendor[13];
    if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return 1;
    memcpy(vendor, &ebx, 4);
    memcpy(vendor + 4, &edx, 4);
    memcpy(vendor + 8, &ecx, 4);
    vendor[12] = 0;
    return !(strcmp(vendor, "AuthenticAMD") == 0 && family == 25);
#else
    return 1;
#endif
}

static int prefetch_runs_known = -1;

/* prefetch_runs_of_cpu, asked once: CPUID may trap to the hypervisor in a virtual machine, and this is read every
 * layer of every step (a racing first call stores the same value). */
int paged_attention_prefetch_runs(void) {
    int value = __atomic_load_n(&prefetch_runs_known, __ATOMIC_RELAXED);
    if (value < 0) {
        value = prefetch_runs_of_cpu();
        __atomic_store_n(&prefetch_runs_known, value, __ATOMIC_RELAXED);
    }
    return value;
}

/* Either way for every later call (0 or 1), or the CPU's way again (-1): so tests hold both to the same bits on
 * any CPU, and benchmarks can time both on one. */
void paged_attention_set_prefetch_runs(int value) {
    __atomic_store_n(&prefetch_runs_known, value < 0 ? -1 : !!value, __ATOMIC_RELAXED);
}

int paged_decode_attention_kv(const void *q, const void *k_cache, const void *v_cache, void *out,
                              const int32_t *context_lens, const int32_t *block_tables, int64_t num_slots,
                              int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                              int max_blocks, int is_bf16, float scale, int kv_kind, const float *k_scale,
                              const float *v_scale);
int write_kv_quant(const void *k, const void *v, int64_t k_stride, int64_t v_stride, void *k_cache, void *v_cache,
                   const int64_t *slots, int64_t tokens, int num_kv_heads, int64_t num_slots, int head_dim,
                   int elem_size, int kv_kind, float *k_scale, float *v_scale);

/* q, out: (num_seqs, num_heads, head_dim); caches: (num_kv_heads, num_slots, head_dim), all
 * contiguous, float32 (is_bf16 = 0) or bfloat16; context_lens >= 1. Returns 0, or < 0 if the
 * shapes are unsupported (-1), scratch memory could not be had (-2), a block-table entry the
 * context reaches is outside the pool (-3) or a context is longer than its table row (-4); on
 * -1, -3 and -4 nothing is read from the caches or written to out. */
int paged_decode_attention(const void *q, const void *k_cache, const void *v_cache, void *out,
                           const int32_t *context_lens, const int32_t *block_tables, int64_t num_slots,
                           int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                           int max_blocks, int is_bf16, float scale) {
    return paged_decode_attention_kv(q, k_cache, v_cache, out, context_lens, block_tables, num_slots, num_seqs,
                                     num_heads, num_kv_heads, head_dim, block_size, max_blocks, is_bf16, scale,
                                     KV_SAME, NULL, NULL);
}

/* paged_decode_attention over caches of kind kv_kind: KV_SAME (q's dtype, scales NULL), KV_FP8 (e4m3 bytes,
 * k_scale and v_scale one float each) or KV_INT8 (int8, k_scale and v_scale (num_kv_heads, num_slots)). */
int paged_decode_attention_kv(const void *q, const void *k_cache, const void *v_cache, void *out,
                              const int32_t *context_lens, const int32_t *block_tables, int64_t num_slots,
                              int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                              int max_blocks, int is_bf16, float scale, int kv_kind, const float *k_scale,
                              const float *v_scale) {
    if (num_kv_heads < 1 || num_heads % num_kv_heads || num_heads / num_kv_heads > 64 || head_dim < 1 ||
        block_size < 1 || kv_kind < KV_SAME || kv_kind > KV_INT8 || (kv_kind != KV_SAME && (!k_scale || !v_scale)))
        return -1;
    const int table_status = check_block_tables(context_lens, block_tables, num_slots, num_seqs, block_size,
                                                max_blocks);
    if (table_status) return table_status;
    const int elem = kv_kind == KV_FP8 ? ELEM_FP8 : kv_kind == KV_INT8 ? ELEM_INT8 : is_bf16 ? ELEM_BF16 : ELEM_F32;
#ifdef Q8B_PATH
    /* Built once per kind (every layer of every step would otherwise rebuild them); a racing first build
     * writes the same bytes. */
    static uint8_t tables[2][TABLE_BYTES] __attribute__((aligned(64)));
    static int built[2];
    const int t = kv_kind == KV_FP8;
    if (kv_kind != KV_SAME && !__atomic_load_n(&built[t], __ATOMIC_ACQUIRE)) {
        kv8_byte_tables(tables[t], t);
        __atomic_store_n(&built[t], 1, __ATOMIC_RELEASE);
    }
    const uint8_t *table_ptr = kv_kind != KV_SAME ? tables[t] : NULL;
#else
    const uint8_t *table_ptr = NULL;
#endif
    const Args a = {q, k_cache, v_cache, out, context_lens, block_tables, num_slots, num_heads, num_kv_heads,
                    head_dim, block_size, max_blocks, is_bf16, scale, kv_kind, elem, k_scale, v_scale, table_ptr,
                    paged_attention_prefetch_runs()};
    const int group = num_heads / num_kv_heads, num_items = num_seqs * num_kv_heads;
    int failed = 0;
#pragma omp parallel
    {
        Scratch w;
        w.q = malloc(sizeof(float) * group * head_dim);
        w.acc = malloc(sizeof(float) * group * head_dim);
        w.scores = malloc(sizeof(float) * group * KEY_CHUNK);
        w.keys = malloc(sizeof(char *) * 2 * VALUES_AT);
        w.k_scales = malloc(sizeof(float) * 2 * KEY_CHUNK);
        w.v_scales = w.k_scales ? w.k_scales + KEY_CHUNK : NULL;
        if (!w.q || !w.acc || !w.scores || !w.keys || !w.k_scales) {
#pragma omp atomic write
            failed = 1;
        }
        /* Every thread takes part in the loop (an omp for must be met by all); a thread without
         * scratch skips its items, and the caller sees the failure. */
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < num_items; i++)
            if (w.q && w.acc && w.scores && w.keys && w.k_scales) attend(&a, &w, i / num_kv_heads, i % num_kv_heads);
        free(w.k_scales);
        free(w.q);
        free(w.acc);
        free(w.scores);
        free(w.keys);
    }
    return failed ? -2 : 0;
}

/* Each new token's K and V rows into its cache slot: torch's two index_copy_ calls and their
 * transposes in one call, every layer of every step. k, v: token t's heads at k + t * k_stride
 * (elements), heads contiguous within a token; caches: (num_kv_heads, num_slots, head_dim),
 * contiguous; slots: (tokens,). Returns 0, or -1 (writing nothing) if a slot is out of range. */
int write_kv(const void *k, const void *v, int64_t k_stride, int64_t v_stride, void *k_cache, void *v_cache,
             const int64_t *slots, int64_t tokens, int num_kv_heads, int64_t num_slots, int head_dim,
             int elem_size) {
    return write_kv_quant(k, v, k_stride, v_stride, k_cache, v_cache, slots, tokens, num_kv_heads, num_slots,
                          head_dim, elem_size, KV_SAME, NULL, NULL);
}

/* write_kv into caches of kind kv_kind (paged_decode_attention_kv's): an 8-bit cache's rows quantized as they
 * are written (kv8.h), from k and v in float32 (elem_size 4) or bf16 (2); an int8 cache's row scales written
 * to k_scale and v_scale at [head, slot]; fp8 reads its per-layer k_scale[0] and v_scale[0]. Returns 0, -1
 * (writing nothing) if a slot is out of range, or -2 for an unknown kind or a row longer than 1,024. */
int write_kv_quant(const void *k, const void *v, int64_t k_stride, int64_t v_stride, void *k_cache, void *v_cache,
                   const int64_t *slots, int64_t tokens, int num_kv_heads, int64_t num_slots, int head_dim,
                   int elem_size, int kv_kind, float *k_scale, float *v_scale) {
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    if (kv_kind == KV_SAME) {
        const size_t row = (size_t)head_dim * elem_size;
        for (int64_t t = 0; t < tokens; t++) {
            for (int h = 0; h < num_kv_heads; h++) {
                const size_t dst = ((size_t)h * num_slots + slots[t]) * row;
                memcpy((char *)k_cache + dst, (const char *)k + (t * k_stride + (int64_t)h * head_dim) * elem_size,
                       row);
                memcpy((char *)v_cache + dst, (const char *)v + (t * v_stride + (int64_t)h * head_dim) * elem_size,
                       row);
            }
        }
        return 0;
    }
    if ((kv_kind != KV_FP8 && kv_kind != KV_INT8) || head_dim > 1024 || !k_scale || !v_scale) return -2;
    /* A prompt's tokens are many: split over the threads (each row is written by one). */
#pragma omp parallel for schedule(static) if (tokens * num_kv_heads >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        float x[1024];
        for (int h = 0; h < num_kv_heads; h++) {
            const size_t dst = (size_t)h * num_slots + slots[t];
            for (int which = 0; which < 2; which++) {
                const void *src = which ? v : k;
                const int64_t at = t * (which ? v_stride : k_stride) + (int64_t)h * head_dim;
                for (int d = 0; d < head_dim; d++)
                    x[d] = elem_size == 2 ? bf16_to_f32(((const uint16_t *)src)[at + d]) : ((const float *)src)[at + d];
                float *scales = which ? v_scale : k_scale;
                uint8_t *row = (uint8_t *)(which ? v_cache : k_cache) + dst * head_dim;
                const float s = quantize_row(x, row, head_dim, kv_kind, kv_kind == KV_FP8 ? scales[0] : 0.0f);
                if (kv_kind == KV_INT8) scales[dst] = s;
            }
        }
    }
    return 0;
}
