/* LoRA for a batch of rows grouped by adapter (Punica's SGMV): y[r] += (x[r] A_s^T) B_s^T for each row r of
 * each segment s, one shrink and one expand per segment, float32 sums, y rounded once.
 *
 * Layouts (the slots of one linear layer, model/lora/slots.py): a (slots, parts x R, in) and b (slots, R, out),
 * B stored transposed so the expand runs along the outputs, and the scaling folded into b. A fused layer (q/k/v,
 * gate/up) has several parts: the outputs of part p read columns p x R .. p x R + rank of the shrink. Only the
 * first `rank` of each part's R are read, so a low-rank adapter in a slot sized for a higher one costs its own rank.
 *
 * One parallel region a call with one barrier in it, between the shrink (split over every segment's (part, rank)
 * rows) and the expand (split over blocks of 16 outputs, every segment within each): a decode step calls this once
 * per linear layer, and on a shared machine each barrier can wait a time slice for a descheduled thread. A barrier
 * per segment and phase made a 16-row step over 4 adapters 6x slower under load.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define LANES 16
/* Multiply-adds below which a call runs on one thread. */
#define PARALLEL_MIN_WORK (1 << 20)

/* Separate partial sums per lane, so the compiler vectorises without reassociating a single sum. */
static float dot_f32(const float *x, const float *w, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += x[i + j] * w[i + j];
    float sum = 0.0f;
    for (int j = 0; j < LANES; j++) sum += acc[j];
    for (; i < n; i++) sum += x[i] * w[i];
    return sum;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#endif

static float dot_bf16(const uint16_t *x, const uint16_t *w, int64_t n) {
#ifdef HAVE_BF16_DOT
    /* Pairs of bf16 products summed into float32 lanes (vdpbf16ps), as the matmul kernels do. */
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x + i), (__m512bh)_mm512_loadu_si512(w + i));
    float sum = _mm512_reduce_add_ps(acc);
    for (; i < n; i++) sum += bf16_to_f32(x[i]) * bf16_to_f32(w[i]);
    return sum;
#else
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += bf16_to_f32(x[i + j]) * bf16_to_f32(w[i + j]);
    float sum = 0.0f;
    for (int j = 0; j < LANES; j++) sum += acc[j];
    for (; i < n; i++) sum += bf16_to_f32(x[i]) * bf16_to_f32(w[i]);
    return sum;
#endif
}

#ifdef HAVE_BF16_DOT
/* Four rows' dot products with one A row, each A chunk loaded once: out[r * stride] for rows[r], r < 4. */
static void dot4_bf16(const uint16_t *x, const int64_t *rows, const uint16_t *w, int64_t n, float *out,
                      int64_t stride) {
    const uint16_t *xs[4] = {x + rows[0] * n, x + rows[1] * n, x + rows[2] * n, x + rows[3] * n};
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + i);
        for (int r = 0; r < 4; r++) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(xs[r] + i), wv);
    }
    for (int r = 0; r < 4; r++) {
        float sum = _mm512_reduce_add_ps(acc[r]);
        for (int64_t j = i; j < n; j++) sum += bf16_to_f32(xs[r][j]) * bf16_to_f32(w[j]);
        out[r * stride] = sum;
    }
}

/* How many blocks ahead the expand fetches B. A block reads `rank` rows of B `out` apart, for every segment in
 * turn: more strided streams than the hardware prefetcher follows, so without this each block waited on memory.
 * The 0.6B model's 112 expands of 16 rows over 4 rank-16 adapters took 8.5 ms a step, 4.7 ms with it (one thread). */
#define EXPAND_PREFETCH_BLOCKS 4

/* One segment's rows over a whole block of LANES outputs, bf16: the block's B values widened once, then for each
 * row its rank multiply-adds of 16 lanes, added into y with one rounding. */
static void expand_block_bf16(uint16_t *y, const uint16_t *b, const float *shrunk, const int64_t *rows,
                              int64_t first, int64_t last, int64_t rank, int64_t out, int64_t shrunk_width,
                              int64_t part_column, int64_t o0) {
    __m512 w[rank > 0 ? rank : 1];
    for (int64_t k = 0; k < rank; k++) {
        /* A hint, never a fault: past the end of b it fetches nothing useful and harms nothing. */
        _mm_prefetch((const char *)(b + k * out + EXPAND_PREFETCH_BLOCKS * LANES), _MM_HINT_T0);
        w[k] = load_bf16(b + k * out);
    }
    int64_t m = first;
    /* Four rows at once: four independent chains of multiply-adds instead of one chain's latency per row. */
    for (; m + 4 <= last; m += 4) {
        const float *t = shrunk + m * shrunk_width + part_column;
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t k = 0; k < rank; k++)
            for (int r = 0; r < 4; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(t[r * shrunk_width + k]), w[k], acc[r]);
        for (int r = 0; r < 4; r++) {
            uint16_t *yp = y + rows[m + r] * out + o0;
            store_bf16(yp, round_bf16x16(_mm512_add_ps(load_bf16(yp), acc[r])));
        }
    }
    for (; m < last; m++) {
        const float *t = shrunk + m * shrunk_width + part_column;
        __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 2 <= rank; k += 2) {
            even = _mm512_fmadd_ps(_mm512_set1_ps(t[k]), w[k], even);
            odd = _mm512_fmadd_ps(_mm512_set1_ps(t[k + 1]), w[k + 1], odd);
        }
        if (k < rank) even = _mm512_fmadd_ps(_mm512_set1_ps(t[k]), w[k], even);
        uint16_t *yp = y + rows[m] * out + o0;
        store_bf16(yp, round_bf16x16(_mm512_add_ps(load_bf16(yp), _mm512_add_ps(even, odd))));
    }
}
#endif

static inline float load_one(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* bf16: 1 when x, y, a and b are bf16, 0 when float32. Returns 0, or -1 where scratch memory is short. */
int lora_sgmv(void *y, const void *x, const void *a, const void *b, int bf16, const int64_t *rows,
              const int64_t *starts, const int64_t *slots, const int64_t *ranks, int64_t num_segments,
              int64_t in, int64_t out, int64_t width, int64_t num_parts, const int64_t *part_ends) {
    const int64_t total = starts[num_segments];
    const int64_t shrunk_width = num_parts * width;
    float *shrunk = calloc((size_t)(total * shrunk_width), sizeof(float)); /* x A^T per row */
    int64_t *item_starts = malloc(sizeof(int64_t) * (size_t)(num_segments + 1));
    int64_t *block_starts = malloc(sizeof(int64_t) * (size_t)(num_parts + 1));
    if (shrunk == NULL || item_starts == NULL || block_starts == NULL) {
        free(shrunk);
        free(item_starts);
        free(block_starts);
        return -1;
    }
    /* The shrink's work items: segment s has parts x rank of them (one A row each, all its rows). */
    item_starts[0] = 0;
    for (int64_t s = 0; s < num_segments; s++) item_starts[s + 1] = item_starts[s] + num_parts * ranks[s];
    /* The expand's: blocks of LANES outputs, none straddling a part's end. */
    block_starts[0] = 0;
    for (int64_t p = 0; p < num_parts; p++) {
        const int64_t begin = p ? part_ends[p - 1] : 0;
        block_starts[p + 1] = block_starts[p] + (part_ends[p] - begin + LANES - 1) / LANES;
    }
    /* A decode step's few rows take tens of microseconds: one thread, no wake-ups or barrier. */
    const int64_t work = total * shrunk_width * (in + out);
#pragma omp parallel if (work > PARALLEL_MIN_WORK)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < item_starts[num_segments]; item++) {
            int64_t s = 0;
            while (item >= item_starts[s + 1]) s++;
            const int64_t rank = ranks[s], j = item - item_starts[s];
            const int64_t col = (j / rank) * width + j % rank;
            const int64_t a_row = (slots[s] * shrunk_width + col) * in;
            int64_t m = starts[s];
#ifdef HAVE_BF16_DOT
            if (bf16)
                for (; m + 4 <= starts[s + 1]; m += 4)
                    dot4_bf16((const uint16_t *)x, rows + m, (const uint16_t *)a + a_row, in,
                              shrunk + m * shrunk_width + col, shrunk_width);
#endif
            for (; m < starts[s + 1]; m++) {
                const int64_t x_row = rows[m] * in;
                shrunk[m * shrunk_width + col] = bf16
                    ? dot_bf16((const uint16_t *)x + x_row, (const uint16_t *)a + a_row, in)
                    : dot_f32((const float *)x + x_row, (const float *)a + a_row, in);
            }
        }
#pragma omp for schedule(static)
        for (int64_t block = 0; block < block_starts[num_parts]; block++) {
            int64_t part = 0;
            while (block >= block_starts[part + 1]) part++;
            const int64_t o0 = (part ? part_ends[part - 1] : 0) + (block - block_starts[part]) * LANES;
            const int64_t n = part_ends[part] - o0 < LANES ? part_ends[part] - o0 : LANES;
            for (int64_t s = 0; s < num_segments; s++) {
                const int64_t rank = ranks[s];
                const int64_t b_base = slots[s] * width * out + o0;
#ifdef HAVE_BF16_DOT
                if (bf16 && n == LANES) {
                    expand_block_bf16((uint16_t *)y, (const uint16_t *)b + b_base, shrunk, rows, starts[s],
                                      starts[s + 1], rank, out, shrunk_width, part * width, o0);
                    continue;
                }
#endif
                float w[width > 0 ? width : 1][LANES];
                for (int64_t k = 0; k < rank; k++)
                    for (int64_t i = 0; i < LANES; i++) w[k][i] = i < n ? load_one(b, b_base + k * out + i, bf16) : 0.0f;
                for (int64_t m = starts[s]; m < starts[s + 1]; m++) {
                    const float *t = shrunk + m * shrunk_width + part * width;
                    float acc[LANES] = {0};
                    for (int64_t k = 0; k < rank; k++)
                        for (int i = 0; i < LANES; i++) acc[i] += t[k] * w[k][i];
                    const int64_t at = rows[m] * out + o0;
                    if (bf16) {
                        uint16_t *yp = (uint16_t *)y + at;
                        for (int64_t i = 0; i < n; i++) yp[i] = f32_to_bf16(bf16_to_f32(yp[i]) + acc[i]);
                    } else {
                        float *yp = (float *)y + at;
                        for (int64_t i = 0; i < n; i++) yp[i] += acc[i];
                    }
                }
            }
        }
    }
    free(shrunk);
    free(item_starts);
    free(block_starts);
    return 0;
}
