/* Mixture-of-experts SwiGLU experts on the CPU: every (token, chosen expert) pair grouped by expert, and
 * each expert's weights read once for all the pairs that chose it; experts no pair chose are never read.
 *
 *   out[t] = sum_j weight[t, j] * W2[e] (silu(W1[e] x[t]) * W3[e] x[t]),   e = ids[t, j]
 *
 * with W1 (gate) and W3 (up) the two halves of w13[e] (2I, H) and W2 = w2[e] (H, I). The arithmetic
 * is float32 throughout (weights and inputs widened from bf16), rounded to the model dtype once at
 * the end. Plain C that the compiler vectorises for the machine it runs on (-march=native): it needs
 * no AVX-512 or AMX, only that the accumulators below map onto whatever vector registers there are.
 * Where the CPU has AVX512-BF16, bf16 rows are multiplied as bf16 pairs instead (products exact in
 * float32 either way), and silu(gate) * up is rounded to bf16 before the down projection.
 *
 * moe_experts_q8 takes 8-bit experts (int8, or fp8 e4m3 as Qwen's FP8 checkpoints hold them): only the
 * chosen experts' bytes are read, widened to float32 in registers and multiplied by their scale (one
 * float32 per weight row and block of inputs: fp8's 128-wide blocks, or the whole row for int8), so every
 * product is with float32(q * scale), the weight a float32 dequantization holds. No bf16 copy is made.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define LANES 16      /* floats per vector below; GCC splits it onto whatever registers the CPU has */
#define PAIR_BLOCK 4  /* pairs multiplied by one weight row at a time, while the row is in L1 */
#define ROW_BLOCK 16  /* weight rows per unit of parallel work */

/* GCC's generic vectors: AVX-512 registers where there are some, two AVX2 or four SSE ones otherwise. */
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef uint16_t vh __attribute__((vector_size(2 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));

static inline __attribute__((always_inline)) vf load_w(const void *w, const int is_bf16, int d) {
    vf f;
    if (is_bf16) {
        vh h;
        memcpy(&h, (const uint16_t *)w + d, sizeof(h));
        const vu u = __builtin_convertvector(h, vu) << 16; /* bf16 is the top half of a float32 */
        memcpy(&f, &u, sizeof(f));
    } else {
        memcpy(&f, (const float *)w + d, sizeof(f));
    }
    return f;
}

static inline __attribute__((always_inline)) vf load_x(const float *x) {
    vf f;
    memcpy(&f, x, sizeof(f));
    return f;
}

/* out[i] = dot(w, xs[i]) for n (<= PAIR_BLOCK, a constant once inlined) float rows of length dim. */
static inline __attribute__((always_inline)) void dots_n(const void *w, const int is_bf16, const float *const *xs,
                                                         const int n, int dim, float *out) {
    /* Two chains of partial sums per row (four for a lone row), so adds overlap instead of waiting. */
    vf acc[PAIR_BLOCK][2], one[2] = {{0}, {0}};
    for (int i = 0; i < n; i++) acc[i][0] = acc[i][1] = (vf){0};
    const int whole = dim - dim % (4 * LANES);
    for (int d = 0; d < whole; d += 4 * LANES) {
        const vf w0 = load_w(w, is_bf16, d), w1 = load_w(w, is_bf16, d + LANES);
        const vf w2 = load_w(w, is_bf16, d + 2 * LANES), w3 = load_w(w, is_bf16, d + 3 * LANES);
        if (n == 1) {
            acc[0][0] += w0 * load_x(xs[0] + d);
            acc[0][1] += w1 * load_x(xs[0] + d + LANES);
            one[0] += w2 * load_x(xs[0] + d + 2 * LANES);
            one[1] += w3 * load_x(xs[0] + d + 3 * LANES);
            continue;
        }
        for (int i = 0; i < n; i++) {
            acc[i][0] += w0 * load_x(xs[i] + d) + w2 * load_x(xs[i] + d + 2 * LANES);
            acc[i][1] += w1 * load_x(xs[i] + d + LANES) + w3 * load_x(xs[i] + d + 3 * LANES);
        }
    }
    acc[0][0] += one[0];
    acc[0][1] += one[1];
    for (int i = 0; i < n; i++) {
        const vf total = acc[i][0] + acc[i][1];
        float sum = 0.0f;
        for (int l = 0; l < LANES; l++) sum += total[l];
        for (int d = whole; d < dim; d++)
            sum += (is_bf16 ? bf16_to_f32(((const uint16_t *)w)[d]) : ((const float *)w)[d]) * xs[i][d];
        out[i] = sum;
    }
}

static void dots(const void *w, int is_bf16, const float *const *xs, int n, int dim, float *out) {
    if (is_bf16) {
        switch (n) {
        case 1: dots_n(w, 1, xs, 1, dim, out); return;
        case 2: dots_n(w, 1, xs, 2, dim, out); return;
        case 3: dots_n(w, 1, xs, 3, dim, out); return;
        default: dots_n(w, 1, xs, 4, dim, out); return;
        }
    }
    switch (n) {
    case 1: dots_n(w, 0, xs, 1, dim, out); return;
    case 2: dots_n(w, 0, xs, 2, dim, out); return;
    case 3: dots_n(w, 0, xs, 3, dim, out); return;
    default: dots_n(w, 0, xs, 4, dim, out); return;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DPBF16 1

/* As dots, for bf16 rows against bf16 weights where the CPU multiplies bf16 pairs itself (AVX512-BF16):
 * each product is exact in float32 and the sums are float32, as above, in half the instructions. */
static inline __attribute__((always_inline)) void dots_bf16_n(const uint16_t *w, const uint16_t *const *xs,
                                                              const int n, int dim, float *out) {
    __m512 acc[PAIR_BLOCK][2];
    for (int i = 0; i < n; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const int whole = dim - dim % 64;
    for (int d = 0; d < whole; d += 64) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + d), w1 = (__m512bh)_mm512_loadu_si512(w + d + 32);
        for (int i = 0; i < n; i++) {
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, (__m512bh)_mm512_loadu_si512(xs[i] + d));
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, (__m512bh)_mm512_loadu_si512(xs[i] + d + 32));
        }
    }
    for (int i = 0; i < n; i++) {
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));
        for (int d = whole; d < dim; d++) sum += bf16_to_f32(w[d]) * bf16_to_f32(xs[i][d]);
        out[i] = sum;
    }
}

static void dots_bf16(const uint16_t *w, const uint16_t *const *xs, int n, int dim, float *out) {
    switch (n) {
    case 1: dots_bf16_n(w, xs, 1, dim, out); return;
    case 2: dots_bf16_n(w, xs, 2, dim, out); return;
    case 3: dots_bf16_n(w, xs, 3, dim, out); return;
    default: dots_bf16_n(w, xs, 4, dim, out); return;
    }
}
#else
#define HAVE_DPBF16 0
#endif

/* ---- 8-bit weights ---- */
typedef int8_t vb __attribute__((vector_size(LANES)));
typedef uint8_t vub __attribute__((vector_size(LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));

#if LANES == 16 && (defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__)))
#define X86_WIDEN 1
#define WIDE_FP8_UNIT 256.0f /* widen_q8's fp8 lanes hold 2^-8 of the value: scales are taken times this */
#else
#define X86_WIDEN 0
#define WIDE_FP8_UNIT 1.0f
#endif

/* LANES weights as their float32 value (fp8: 1 / WIDE_FP8_UNIT of it). int8 converts. Off x86, an e4m3
 * byte s.eeee.mmm is rebuilt as a float32 in integer lanes (no fp8 or float16 instructions needed): for
 * eeee > 0 the value is 2^(eeee - 7) (1 + mmm / 8), the float32 with exponent field eeee + 120 and
 * mantissa mmm << 20;
 * for eeee = 0 it is mmm * 2^-9, built as 2^-6 (1 + mmm / 8) - 2^-6 so that no lane is ever a float32
 * subnormal (which a flush-to-zero mode would zero). The sign bit is copied across. (e4m3fn's NaN bytes
 * become finite numbers: no checkpoint has them.) */
static inline __attribute__((always_inline)) vf widen_q8(const uint8_t *p, const int fp8) {
#if X86_WIDEN
    /* GCC turns the generic conversions below into one byte at a time: on x86 the same values come from the
     * vector instructions. e4m3 sign-extended to 16 bits and shifted left 7 is the float16 of 2^-8 its value
     * (0xBF80 clears the sign's copy in the exponent's top bit), subnormals included: the 2^8 goes into
     * the scale (WIDE_FP8_UNIT), which is exact, so the product is still float32(q * scale). */
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    vf f;
#if defined(__AVX512F__)
    const __m512 v = fp8 ? _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                                            _mm256_set1_epi16((short)0xBF80)))
                         : _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    memcpy(&f, &v, sizeof(f));
#else
    __m256 v[2];
    if (fp8) {
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                           _mm256_set1_epi16((short)0xBF80));
        v[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        v[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    } else {
        v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
        v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    }
    memcpy(&f, v, sizeof(f));
#endif
    return f;
#else
    if (!fp8) {
        vb b;
        memcpy(&b, p, sizeof(b));
        return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
    }
    vub b;
    memcpy(&b, p, sizeof(b));
    const vu u = __builtin_convertvector(b, vu);
    const vu mag = u & 0x7f, sign = (u & 0x80) << 24;
    const vu sub = (vu)(mag < 8); /* all ones where the exponent field is zero */
    const vu bits = ((mag << 20) + (120u << 23) + (sub & (1u << 23))) | sign;
    const vu fix = sub & (0x3c800000u | sign); /* +-2^-6 where subnormal, 0 elsewhere */
    vf f, g;
    memcpy(&f, &bits, sizeof(f));
    memcpy(&g, &fix, sizeof(g));
    return f - g;
#endif
}

/* One byte's exact value. */
static inline float q8_value(uint8_t b, const int fp8) {
    if (!fp8) return (float)(int8_t)b;
    const int e = (b >> 3) & 15, m = b & 7;
    const float v = e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9);
    return b & 0x80 ? -v : v;
}

/* out[j * PAIR_BLOCK + i] = dot(q_j * scale_j, xs[i]) over dim inputs, for R (1 or 2) weight rows w[j] and n
 * (<= PAIR_BLOCK) input rows: scales[j] holds row j's one scale per block of bk inputs (the last block may be
 * partial). Each widened vector is multiplied by its block's scale before it meets the inputs, so the
 * products are with float32(q * scale). Two weight rows at a time share the inputs' loads and give the
 * multiply-adds independent chains to overlap. */
static inline __attribute__((always_inline)) void dots_q8_n(const uint8_t *const *w, const float *const *scales,
                                                            const int R, int bk, const int fp8,
                                                            const float *const *xs, const int n, int dim,
                                                            float *out) {
    vf acc[2][PAIR_BLOCK][2];
    float tail[2][PAIR_BLOCK] = {{0}};
    for (int j = 0; j < R; j++)
        for (int i = 0; i < n; i++) acc[j][i][0] = acc[j][i][1] = (vf){0};
    for (int k0 = 0, b = 0; k0 < dim; k0 += bk, b++) {
        const int k1 = k0 + bk < dim ? k0 + bk : dim;
        float scale[2];
        for (int j = 0; j < R; j++) scale[j] = fp8 ? scales[j][b] * WIDE_FP8_UNIT : scales[j][b]; /* exact */
        int d = k0;
        for (; d + 2 * LANES <= k1; d += 2 * LANES) {
            vf w0[2], w1[2];
            for (int j = 0; j < R; j++) {
                w0[j] = widen_q8(w[j] + d, fp8) * scale[j];
                w1[j] = widen_q8(w[j] + d + LANES, fp8) * scale[j];
            }
            for (int i = 0; i < n; i++) {
                const vf x0 = load_x(xs[i] + d), x1 = load_x(xs[i] + d + LANES);
                for (int j = 0; j < R; j++) {
                    acc[j][i][0] += w0[j] * x0;
                    acc[j][i][1] += w1[j] * x1;
                }
            }
        }
        for (; d + LANES <= k1; d += LANES) {
            for (int j = 0; j < R; j++) {
                const vf w0 = widen_q8(w[j] + d, fp8) * scale[j];
                for (int i = 0; i < n; i++) acc[j][i][0] += w0 * load_x(xs[i] + d);
            }
        }
        for (; d < k1; d++)
            for (int j = 0; j < R; j++) {
                const float wd = q8_value(w[j][d], fp8) * scales[j][b];
                for (int i = 0; i < n; i++) tail[j][i] += wd * xs[i][d];
            }
    }
    for (int j = 0; j < R; j++)
        for (int i = 0; i < n; i++) {
            const vf total = acc[j][i][0] + acc[j][i][1];
            float sum = tail[j][i];
            for (int l = 0; l < LANES; l++) sum += total[l];
            out[j * PAIR_BLOCK + i] = sum;
        }
}

/* dots_q8_n with its shape arguments made constants, so the loops over them unroll into registers. */
#define DOTS_Q8_N(FP8, R)                                                                           \
    switch (n) {                                                                                    \
    case 1: dots_q8_n(w, scales, R, bk, FP8, xs, 1, dim, out); return;                              \
    case 2: dots_q8_n(w, scales, R, bk, FP8, xs, 2, dim, out); return;                              \
    case 3: dots_q8_n(w, scales, R, bk, FP8, xs, 3, dim, out); return;                              \
    default: dots_q8_n(w, scales, R, bk, FP8, xs, 4, dim, out); return;                             \
    }

static void dots_q8(const uint8_t *const *w, const float *const *scales, int rows, int bk, int fp8,
                    const float *const *xs, int n, int dim, float *out) {
    if (fp8 && rows == 2) DOTS_Q8_N(1, 2)
    if (fp8) DOTS_Q8_N(1, 1)
    if (rows == 2) DOTS_Q8_N(0, 2)
    DOTS_Q8_N(0, 1)
}

/* The experts' weights as the kernel reads them: kind 0 float32, 1 bf16, 2 int8, 3 fp8 e4m3. 8-bit
 * weights carry float32 scales s13 (E, 2I, ceil(H / bk13)) and s2 (E, H, ceil(I / bk2)). */
typedef struct {
    int kind;
    const void *w13, *w2;
    const float *s13, *s2;
    int bk13, bk2;
} Weights;

typedef struct {
    int expert;
    int row; /* first weight row of this unit */
} Item;

/* Units of ROW_BLOCK weight rows (out of `rows`) of every expert some pair chose; returns how many. */
static int work_items(const int64_t *start, const int64_t *count, int num_experts, int rows, Item *items) {
    int n = 0;
    for (int e = 0; e < num_experts; e++) {
        if (!count[e]) continue;
        for (int r = 0; r < rows; r += ROW_BLOCK) items[n++] = (Item){e, r};
    }
    (void)start;
    return n;
}

/* x (T, H) and out (T, H) in the model dtype; ids (T, K) int64 and weights (T, K) float32; the experts
 * in W. scratch: float32, at least T*K*(2H + I) values. dtype: 0 float32, 1 bf16. */
static void experts(const void *x, const int64_t *ids, const float *weights, const Weights *W, void *out,
                    float *scratch, int64_t tokens, int top_k, int num_experts, int hidden, int intermediate,
                    int dtype) {
    const int is_bf16 = dtype == 1;
    const int q8 = W->kind >= 2, fp8 = W->kind == 3;
    const void *w13 = W->w13, *w2 = W->w2;
    const int w_bf16 = W->kind == 1; /* the weights' own dtype: bf16 weights and activations go together */
    const size_t el = q8 ? 1 : is_bf16 ? 2 : 4;
    const int blocks13 = q8 ? (hidden + W->bk13 - 1) / W->bk13 : 0;
    const int blocks2 = q8 ? (intermediate + W->bk2 - 1) / W->bk2 : 0;
    const int64_t pairs = tokens * top_k;
    float *xf = scratch;                       /* (P, H): each sorted pair's input, widened */
    float *act = xf + pairs * hidden;          /* (P, I): silu(gate) * up */
    float *y = act + pairs * intermediate;     /* (P, H): the expert's output, times the pair's weight */

    /* Counting sort of the pairs by expert: pair q = t * K + j goes to sorted position pos[q]. */
    int64_t *count = calloc((size_t)num_experts * 2, sizeof(int64_t));
    int64_t *start = count + num_experts;
    int64_t *pos = malloc((size_t)pairs * 2 * sizeof(int64_t));
    int64_t *token_of = pos + pairs;
    float *pair_weight = malloc((size_t)pairs * sizeof(float));
    for (int64_t q = 0; q < pairs; q++) count[ids[q]]++;
    for (int e = 1; e < num_experts; e++) start[e] = start[e - 1] + count[e - 1];
    {
        int64_t *next = malloc((size_t)num_experts * sizeof(int64_t));
        memcpy(next, start, (size_t)num_experts * sizeof(int64_t));
        for (int64_t q = 0; q < pairs; q++) {
            const int64_t p = next[ids[q]]++;
            pos[q] = p;
            token_of[p] = q / top_k;
            pair_weight[p] = weights[q];
        }
        free(next);
    }

#pragma omp parallel for schedule(static) if (pairs * hidden >= 65536)
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t t = token_of[p];
        for (int d = 0; d < hidden; d++)
            xf[p * hidden + d] = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[t * hidden + d])
                                         : ((const float *)x)[t * hidden + d];
    }

    uint16_t *act_bf16 = HAVE_DPBF16 && w_bf16 ? malloc((size_t)pairs * intermediate * sizeof(uint16_t)) : NULL;
    const int most_rows = hidden > intermediate ? hidden : intermediate;
    Item *items = malloc(((size_t)num_experts * (most_rows / ROW_BLOCK + 1)) * sizeof(Item));

    /* gate and up: row r of W1 and row r of W3 give act[p, r] for every pair p of the expert. */
    int n = work_items(start, count, num_experts, intermediate, items);
#pragma omp parallel for schedule(dynamic, 1)
    for (int it = 0; it < n; it++) {
        const int e = items[it].expert;
        const int end = items[it].row + ROW_BLOCK < intermediate ? items[it].row + ROW_BLOCK : intermediate;
        const char *base = (const char *)w13 + (size_t)e * 2 * intermediate * hidden * el;
        for (int r = items[it].row; r < end; r++) {
            const void *gate_row = base + (size_t)r * hidden * el;
            const void *up_row = base + (size_t)(intermediate + r) * hidden * el;
            for (int64_t p0 = start[e]; p0 < start[e] + count[e]; p0 += PAIR_BLOCK) {
                const int m = (int)(start[e] + count[e] - p0 < PAIR_BLOCK ? start[e] + count[e] - p0 : PAIR_BLOCK);
                float g[PAIR_BLOCK], u[PAIR_BLOCK];
                if (q8) {
                    /* gate and up rows r together: one pass over the inputs */
                    const float *xs[PAIR_BLOCK];
                    const float *scales = W->s13 + ((size_t)e * 2 * intermediate + r) * blocks13;
                    const uint8_t *rows2[2] = {gate_row, up_row};
                    const float *scales2[2] = {scales, scales + (size_t)intermediate * blocks13};
                    float gu[2 * PAIR_BLOCK];
                    for (int i = 0; i < m; i++) xs[i] = xf + (p0 + i) * hidden;
                    dots_q8(rows2, scales2, 2, W->bk13, fp8, xs, m, hidden, gu);
                    for (int i = 0; i < m; i++) g[i] = gu[i], u[i] = gu[PAIR_BLOCK + i];
                } else if (HAVE_DPBF16 && w_bf16) {
#if HAVE_DPBF16
                    const uint16_t *xs[PAIR_BLOCK];
                    for (int i = 0; i < m; i++) xs[i] = (const uint16_t *)x + token_of[p0 + i] * hidden;
                    dots_bf16(gate_row, xs, m, hidden, g);
                    dots_bf16(up_row, xs, m, hidden, u);
#endif
                } else {
                    const float *xs[PAIR_BLOCK];
                    for (int i = 0; i < m; i++) xs[i] = xf + (p0 + i) * hidden;
                    dots(gate_row, w_bf16, xs, m, hidden, g);
                    dots(up_row, w_bf16, xs, m, hidden, u);
                }
                for (int i = 0; i < m; i++) {
                    float a = g[i] / (1.0f + expf(-g[i])) * u[i];
                    /* 8-bit weights in a bf16 model: rounded to bf16, as the 8-bit linear layers' outputs are */
                    if (q8 && is_bf16) a = bf16_to_f32(f32_to_bf16(a));
                    act[(p0 + i) * intermediate + r] = a;
                    if (act_bf16) act_bf16[(p0 + i) * intermediate + r] = f32_to_bf16(a);
                }
            }
        }
    }

    /* down: row r of W2 gives y[p, r], scaled by the pair's routing weight. */
    n = work_items(start, count, num_experts, hidden, items);
#pragma omp parallel for schedule(dynamic, 1)
    for (int it = 0; it < n; it++) {
        const int e = items[it].expert;
        const int end = items[it].row + ROW_BLOCK < hidden ? items[it].row + ROW_BLOCK : hidden;
        const char *base = (const char *)w2 + (size_t)e * hidden * intermediate * el;
        for (int r = items[it].row; r < end; r++) {
            const void *row = base + (size_t)r * intermediate * el;
            const int two = q8 && r + 1 < end; /* 8-bit: rows r and r + 1 in one pass over the activations */
            for (int64_t p0 = start[e]; p0 < start[e] + count[e]; p0 += PAIR_BLOCK) {
                const int m = (int)(start[e] + count[e] - p0 < PAIR_BLOCK ? start[e] + count[e] - p0 : PAIR_BLOCK);
                float v[2 * PAIR_BLOCK];
                if (q8) {
                    const float *as[PAIR_BLOCK];
                    const float *scales = W->s2 + ((size_t)e * hidden + r) * blocks2;
                    const uint8_t *rows2[2] = {row, (const uint8_t *)row + intermediate};
                    const float *scales2[2] = {scales, scales + blocks2};
                    for (int i = 0; i < m; i++) as[i] = act + (p0 + i) * intermediate;
                    dots_q8(rows2, scales2, two ? 2 : 1, W->bk2, fp8, as, m, intermediate, v);
                    if (two)
                        for (int i = 0; i < m; i++) y[(p0 + i) * hidden + r + 1] = v[PAIR_BLOCK + i] * pair_weight[p0 + i];
                } else if (act_bf16) {
#if HAVE_DPBF16
                    /* silu(gate) * up rounded to bf16 first, as a bf16 model's activations are */
                    const uint16_t *as[PAIR_BLOCK];
                    for (int i = 0; i < m; i++) as[i] = act_bf16 + (p0 + i) * intermediate;
                    dots_bf16(row, as, m, intermediate, v);
#endif
                } else {
                    const float *as[PAIR_BLOCK];
                    for (int i = 0; i < m; i++) as[i] = act + (p0 + i) * intermediate;
                    dots(row, w_bf16, as, m, intermediate, v);
                }
                for (int i = 0; i < m; i++) y[(p0 + i) * hidden + r] = v[i] * pair_weight[p0 + i];
            }
            r += two;
        }
    }

    /* Each token's K outputs summed, in choice order, and rounded once. */
#pragma omp parallel for schedule(static) if (tokens * hidden >= 65536)
    for (int64_t t = 0; t < tokens; t++) {
        for (int d = 0; d < hidden; d++) {
            float sum = 0.0f;
            for (int j = 0; j < top_k; j++) sum += y[pos[t * top_k + j] * hidden + d];
            if (is_bf16)
                ((uint16_t *)out)[t * hidden + d] = f32_to_bf16(sum);
            else
                ((float *)out)[t * hidden + d] = sum;
        }
    }
    free(items);
    free(act_bf16);
    free(pair_weight);
    free(pos);
    free(count);
}

void moe_experts(const void *x, const int64_t *ids, const float *weights, const void *w13, const void *w2,
                 void *out, float *scratch, int64_t tokens, int top_k, int num_experts, int hidden,
                 int intermediate, int dtype) {
    const Weights W = {dtype == 1 ? 1 : 0, w13, w2, NULL, NULL, 0, 0};
    experts(x, ids, weights, &W, out, scratch, tokens, top_k, num_experts, hidden, intermediate, dtype);
}

/* As moe_experts with 8-bit experts: w13 (E, 2I, H) and w2 (E, H, I) int8 (fp8 0) or e4m3 bytes (fp8 1),
 * s13 (E, 2I, ceil(H / bk13)) and s2 (E, H, ceil(I / bk2)) their float32 scales. x in float32 or bf16. */
void moe_experts_q8(const void *x, const int64_t *ids, const float *weights, const uint8_t *w13, const float *s13,
                    const uint8_t *w2, const float *s2, void *out, float *scratch, int64_t tokens, int top_k,
                    int num_experts, int hidden, int intermediate, int dtype, int fp8, int bk13, int bk2) {
    const Weights W = {fp8 ? 3 : 2, w13, w2, s13, s2, bk13, bk2};
    experts(x, ids, weights, &W, out, scratch, tokens, top_k, num_experts, hidden, intermediate, dtype);
}
