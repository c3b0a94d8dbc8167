/* RMSNorm rows on the CPU, rounding as the reference does, in one call instead of about ten ops.
 *
 * Each row: y = x * rsqrt(mean(x^2) + eps) in float32, rounded to the model dtype, then times the
 * weight in the model dtype (rounded again): transformers' Qwen3RMSNorm. For a decode step the
 * rows are tiny (one token: 1024 values, or 24 heads of 128), so torch's per-op dispatch cost far
 * more than the arithmetic: about 100 us a call against a few here.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "transpose.h"

#ifdef __AVX512F__
#include <immintrin.h>

/* The vector loops below do the scalar loops' arithmetic, op for op and rounding for rounding, on 16
 * values at a time (dim a multiple of 16). In a prefill of 128 tokens the scalar loops took about 7%
 * of the step: a bf16 conversion with a NaN branch per value kept the compiler from vectorising them. */
static inline __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 rounded(__m512 x) { return _mm512_castsi512_ps(round_bf16x16(x)); }

/* Values already bf16 (low halves zero) stored as bf16. */
static inline void store_bf16x16(uint16_t *p, __m512 x) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
}

/* The wide rows' loops below (bf16, 32 values a step) take 32 bf16 values in one load as two float32
 * vectors, the even places (the low halves shifted up) and the odd ones (the high halves masked), and
 * store two rounded vectors back the same way: two ops where widening and narrowing 16 values took a
 * cross-lane shuffle each. Elementwise arithmetic does not care which places share a vector, and a
 * row's other half (the rotation's partner) sits whole vectors away, in the same places.
 *
 * They round with fast_round: round_bf16x16 without its NaN case. Every NaN these loops round comes
 * from a bf16 value widened (its low 16 bits zero, kept by the products: a NaN operand's payload
 * passes through) or is the default NaN (low bits zero too), so adding at most 0x8000 cannot carry
 * out of the low half, and the NaN stays a NaN. The rounding is otherwise round_bf16x16's, bit for
 * bit. The loads' and stores' shuffles and the NaN blends were most of a 128-token prefill's 11 ms of
 * q/k norm and rotation. */
typedef struct {
    __m512 even, odd;
} bf16x32;

static inline bf16x32 load_bf16x32(const uint16_t *p) {
    const __m512i v = _mm512_loadu_si512(p);
    return (bf16x32){_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
                     _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)))};
}

static inline __m512 fast_round(__m512 x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i sum = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    return _mm512_castsi512_ps(_mm512_and_si512(sum, _mm512_set1_epi32((int)0xFFFF0000u)));
}

static inline void store_bf16x32(uint16_t *p, bf16x32 v) { /* v: rounded (low halves zero) */
    _mm512_storeu_si512(p, _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(v.even), 16),
                                           _mm512_castps_si512(v.odd)));
}

/* round(w * round(x * scale)) on 32 values: norm_row's arithmetic. */
static inline bf16x32 norm32(bf16x32 x, bf16x32 w, __m512 scale) {
    return (bf16x32){fast_round(_mm512_mul_ps(w.even, fast_round(_mm512_mul_ps(x.even, scale)))),
                     fast_round(_mm512_mul_ps(w.odd, fast_round(_mm512_mul_ps(x.odd, scale))))};
}

/* round(round(y * c) + round(partner * s)) on 32 values: rotate_row's arithmetic. */
static inline __m512 rotate16(__m512 y, __m512 partner, __m512 c, __m512 s) {
    return fast_round(_mm512_add_ps(fast_round(_mm512_mul_ps(y, c)), fast_round(_mm512_mul_ps(partner, s))));
}

/* Most values a row rotated in registers may have (128 is Qwen3's head size). */
#define WIDE_ROTATE_MAX 256

/* One bf16 row normalised (and rotated, where cos is not NULL) straight from x into out, given its sum
 * of squares: dim a multiple of 32 (64 with rotation, at most WIDE_ROTATE_MAX). */
__attribute__((optimize("fp-contract=off")))
static inline void wide_row(const uint16_t *x, const uint16_t *w, const uint16_t *cos, const uint16_t *signed_sin,
                            uint16_t *out, int dim, float eps, float sum) {
    const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(sum / (float)dim + eps));
    if (!cos) {
        for (int d = 0; d < dim; d += 32) store_bf16x32(out + d, norm32(load_bf16x32(x + d), load_bf16x32(w + d), scale));
        return;
    }
    bf16x32 y[WIDE_ROTATE_MAX / 32];
    const int n = dim / 32, half = n / 2;
    for (int i = 0; i < n; i++) y[i] = norm32(load_bf16x32(x + i * 32), load_bf16x32(w + i * 32), scale);
    for (int i = 0; i < n; i++) {
        const bf16x32 c = load_bf16x32(cos + i * 32), s = load_bf16x32(signed_sin + i * 32);
        const bf16x32 partner = y[i < half ? i + half : i - half];
        store_bf16x32(out + i * 32, (bf16x32){rotate16(y[i].even, partner.even, c.even, s.even),
                                              rotate16(y[i].odd, partner.odd, c.odd, s.odd)});
    }
}
#endif

/* Rows split across threads from this many values: a decode step of 8 sequences (8 x 1024) and up;
 * one sequence's rows (1024 values, or 24 heads of 128) cost less than waking the other threads. */
#define PARALLEL_VALUES 8192

#define SUM_ROWS 4 /* rows whose sums of squares are added up side by side */
/* From this many rows (a prefill's), bf16 rows of a multiple of 16 values go 16 at a time, one row a
 * vector lane (row_sums16). */
#define WIDE_ROWS 64

/* The sums of squares of `count` (at most SUM_ROWS) rows, row i at x + base[i], each added in
 * order d = 0, 1, ... as a single row's would be: the same float32 sums, but the adds of different
 * rows overlap instead of each waiting on the one before (a row's chain of 128 or 1024 dependent
 * adds was most of a decode step's norm time). */
static inline void row_sums(const void *x, const int64_t *base, int count, int dim, int is_bf16, float *sums) {
    float s[SUM_ROWS] = {0.0f};
    if (count == SUM_ROWS && is_bf16) {
        const uint16_t *r0 = (const uint16_t *)x + base[0], *r1 = (const uint16_t *)x + base[1],
                       *r2 = (const uint16_t *)x + base[2], *r3 = (const uint16_t *)x + base[3];
        for (int d = 0; d < dim; d++) {
            const float a = bf16_to_f32(r0[d]), b = bf16_to_f32(r1[d]), c = bf16_to_f32(r2[d]), e = bf16_to_f32(r3[d]);
            s[0] += a * a;
            s[1] += b * b;
            s[2] += c * c;
            s[3] += e * e;
        }
    } else {
        for (int i = 0; i < count; i++)
            for (int d = 0; d < dim; d++) {
                const float v = is_bf16 ? bf16_to_f32(((const uint16_t *)x)[base[i] + d]) : ((const float *)x)[base[i] + d];
                s[i] += v * v;
            }
    }
    for (int i = 0; i < count; i++) sums[i] = s[i];
}

#ifdef __AVX512F__
/* The sums of squares of 16 bf16 rows, row i at x + base[i], dim a multiple of 16: lane i adds row
 * i's squares in order d = 0, 1, ..., so each sum is row_sums' to the bit, and a 16 x 16 transpose
 * puts value d of the 16 rows in one vector. row_sums' four scalar chains took most of a 128-token
 * prefill's norm time (20 ms of q and k heads, 11 ms of hidden rows, over 28 layers). */
__attribute__((optimize("fp-contract=off")))
static inline void row_sums16(const uint16_t *x, const int64_t *base, int dim, float *sums) {
    __m512 s = _mm512_setzero_ps();
    for (int d = 0; d < dim; d += 16) {
        __m512i v[16];
        for (int i = 0; i < 16; i++) v[i] = _mm512_castps_si512(load_bf16x16(x + base[i] + d));
        transpose16(v);
        for (int j = 0; j < 16; j++) {
            const __m512 f = _mm512_castsi512_ps(v[j]);
            s = _mm512_add_ps(s, _mm512_mul_ps(f, f));
        }
    }
    _mm512_storeu_ps(sums, s);
}
#endif

/* A row's normalised, weighted values as float32, each already rounded to bf16 where the model is
 * bf16: y = w * round(x * rsqrt(mean(x^2) + eps)), rounded, given the row's sum of squares. Separate
 * bf16 and float32 loops, with no per-element branch, so the compiler vectorises them. */
static inline void norm_row(const void *x, int64_t base, const void *weight, int64_t w_base, int dim, float eps,
                            int is_bf16, float sum, float *y) {
    const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
    if (is_bf16) {
        const uint16_t *xr = (const uint16_t *)x + base, *wr = (const uint16_t *)weight + w_base;
#ifdef __AVX512F__
        if (dim % 16 == 0) {
            const __m512 s = _mm512_set1_ps(scale);
            for (int d = 0; d < dim; d += 16)
                _mm512_storeu_ps(y + d, rounded(_mm512_mul_ps(load_bf16x16(wr + d),
                                                              rounded(_mm512_mul_ps(load_bf16x16(xr + d), s)))));
            return;
        }
#endif
        for (int d = 0; d < dim; d++)
            y[d] = bf16_to_f32(f32_to_bf16(bf16_to_f32(wr[d]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[d]) * scale))));
    } else {
        const float *xr = (const float *)x + base, *wr = (const float *)weight + w_base;
        for (int d = 0; d < dim; d++) y[d] = wr[d] * (xr[d] * scale);
    }
}

/* Where row r starts in x: groups of group_rows rows, group_stride elements apart. */
static inline int64_t row_base(int64_t r, int64_t group_stride, int group_rows, int dim) {
    return r / group_rows * group_stride + r % group_rows * (int64_t)dim;
}

/* Where rows r0 .. r0 + count - 1 start in x (base) and their sums of squares, added side by side (16
 * rows by row_sums16 where chunk is 16, else SUM_ROWS at a time by row_sums); count is at most `chunk`,
 * fewer at the end. Returns count. */
static inline int chunk_sums(const void *x, int64_t r0, int64_t rows, int chunk, int64_t group_stride, int group_rows,
                             int dim, int is_bf16, int64_t base[16], float sums[16]) {
    const int count = rows - r0 < chunk ? (int)(rows - r0) : chunk;
    for (int i = 0; i < count; i++) base[i] = row_base(r0 + i, group_stride, group_rows, dim);
#ifdef __AVX512F__
    if (count == 16 && chunk == 16)
        row_sums16((const uint16_t *)x, base, dim, sums);
    else
#endif
        for (int i = 0; i < count; i += SUM_ROWS)
            row_sums(x, base + i, count - i < SUM_ROWS ? count - i : SUM_ROWS, dim, is_bf16, sums + i);
    return count;
}

/* Rows r0 .. r0 + count - 1 normalised into y[i * dim ...] by norm_row, their sums by chunk_sums;
 * returns count. */
static inline int norm_rows(const void *x, int64_t r0, int64_t rows, int chunk, int64_t group_stride, int group_rows,
                            const void *weight, int weight_rows, int dim, float eps, int is_bf16, float *y) {
    int64_t base[16];
    float sums[16];
    const int count = chunk_sums(x, r0, rows, chunk, group_stride, group_rows, dim, is_bf16, base, sums);
    for (int i = 0; i < count; i++)
        norm_row(x, base[i], weight, ((r0 + i) % weight_rows) * (int64_t)dim, dim, eps, is_bf16, sums[i],
                 y + (size_t)i * dim);
    return count;
}

/* Row r of out: y as it is, rounded to bf16 where the model is bf16 (exact: y holds bf16 values). */
static inline void store_row(const float *y, void *out, int64_t r, int dim, int is_bf16) {
    if (is_bf16) {
        uint16_t *o = (uint16_t *)out + r * dim;
#ifdef __AVX512F__
        if (dim % 16 == 0) {
            for (int d = 0; d < dim; d += 16) store_bf16x16(o + d, _mm512_loadu_ps(y + d));
            return;
        }
#endif
        for (int d = 0; d < dim; d++) o[d] = f32_to_bf16(y[d]);
    } else {
        memcpy((float *)out + r * dim, y, sizeof(float) * dim);
    }
}

/* Row r of out: y rotated with the tables' row t (half-split: the first half pairs with the
 * second), each product and the sum rounded to the model dtype in turn, as the torch ops do. */
__attribute__((optimize("fp-contract=off")))
static inline void rotate_row(const float *y, const void *cos, const void *signed_sin, void *out, int64_t r,
                              int64_t t, int dim, int is_bf16) {
    const int half = dim / 2;
    if (is_bf16) {
        const uint16_t *c = (const uint16_t *)cos + t * dim, *s = (const uint16_t *)signed_sin + t * dim;
        uint16_t *o = (uint16_t *)out + r * dim;
#ifdef __AVX512F__
        if (dim % 16 == 0) {
            /* Each place's partner, laid out beside it: a row's halves swapped. Where a half is not a whole
             * number of vectors (heads of 16 or 48), a vector's partners straddle both halves of y. */
            float swapped[dim];
            memcpy(swapped, y + half, sizeof(float) * half);
            memcpy(swapped + half, y, sizeof(float) * half);
            for (int d = 0; d < dim; d += 16) {
                const __m512 a = rounded(_mm512_mul_ps(_mm512_loadu_ps(y + d), load_bf16x16(c + d)));
                const __m512 b = rounded(_mm512_mul_ps(_mm512_loadu_ps(swapped + d), load_bf16x16(s + d)));
                store_bf16x16(o + d, rounded(_mm512_add_ps(a, b)));
            }
            return;
        }
#endif
        for (int d = 0; d < dim; d++) {
            const int partner = d < half ? d + half : d - half;
            const float a = bf16_to_f32(f32_to_bf16(y[d] * bf16_to_f32(c[d])));
            const float b = bf16_to_f32(f32_to_bf16(y[partner] * bf16_to_f32(s[d])));
            o[d] = f32_to_bf16(a + b);
        }
    } else {
        const float *c = (const float *)cos + t * dim, *s = (const float *)signed_sin + t * dim;
        float *o = (float *)out + r * dim;
        for (int d = 0; d < half; d++) o[d] = y[d] * c[d] + y[d + half] * s[d];
        for (int d = half; d < dim; d++) o[d] = y[d] * c[d] + y[d - half] * s[d];
    }
}

/* Rows r0 .. r0 + count - 1 (those below `rows`) pulled into L2: the next chunk's, while this one's are
 * normalised. A chunk of 16 heads reads 32 bytes of each of 16 rows a step, 256 bytes apart, which the
 * hardware's prefetchers did not run ahead of: a 2,048-token prefill's q and k heads (rms_norm_rope), from
 * memory, took 0.76-0.84x the time with them fetched (one core of AMD's Zen 4; 128 and 512 tokens: 0.81x and
 * 0.77x). Rows of 1,024 values, each one stream, gained nothing. */
#ifdef __AVX512F__
static inline void prefetch_rows(const uint16_t *x, int64_t r0, int64_t rows, int count, int64_t group_stride,
                                 int group_rows, int dim) {
    for (int64_t r = r0; r < r0 + count && r < rows; r++)
        for (int l = 0; l < dim * 2; l += 64)
            _mm_prefetch((const char *)(x + row_base(r, group_stride, group_rows, dim)) + l, _MM_HINT_T1);
}
#endif

/* rms_norm, and rms_norm_rope where cos is not NULL. fp-contract=off: the same products and sums
 * in both, so the two agree to the bit. */
__attribute__((optimize("fp-contract=off")))
static void normalise(const void *x, int64_t group_stride, int group_rows, const void *weight, int weight_rows,
                      const void *cos, const void *signed_sin, void *out, int64_t rows, int dim, float eps,
                      int is_bf16) {
#ifdef __AVX512F__
    const int chunk = rows >= WIDE_ROWS && is_bf16 && dim % 16 == 0 ? 16 : SUM_ROWS;
#else
    const int chunk = SUM_ROWS;
#endif
#ifdef __AVX512F__
    if (is_bf16 && dim % 32 == 0 && (!cos || (dim % 64 == 0 && dim <= WIDE_ROTATE_MAX))) {
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_VALUES)
        for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
            int64_t base[16];
            float sums[16];
            if (chunk == 16 && dim <= WIDE_ROTATE_MAX) /* a prompt's heads; a decode step's are in cache */
                prefetch_rows((const uint16_t *)x, r0 + chunk, rows, chunk, group_stride, group_rows, dim);
            const int count = chunk_sums(x, r0, rows, chunk, group_stride, group_rows, dim, 1, base, sums);
            for (int i = 0; i < count; i++) {
                const int64_t r = r0 + i, t = r / group_rows;
                wide_row((const uint16_t *)x + base[i], (const uint16_t *)weight + (r % weight_rows) * (int64_t)dim,
                         cos ? (const uint16_t *)cos + t * dim : NULL,
                         cos ? (const uint16_t *)signed_sin + t * dim : NULL, (uint16_t *)out + r * dim, dim, eps,
                         sums[i]);
            }
        }
        return;
    }
#endif
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_VALUES)
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
        float normed[chunk * dim];
        const int count = norm_rows(x, r0, rows, chunk, group_stride, group_rows, weight, weight_rows, dim, eps,
                                    is_bf16, normed);
        for (int i = 0; i < count; i++) {
            const int64_t r = r0 + i;
            if (cos) rotate_row(normed + (size_t)i * dim, cos, signed_sin, out, r, r / group_rows, dim, is_bf16);
            else store_row(normed + (size_t)i * dim, out, r, dim, is_bf16);
        }
    }
}

/* x: groups of `group_rows` contiguous rows of `dim` values, group g at x + g * group_stride
 * (elements), e.g. a token's heads; out: contiguous (rows, dim); weight: (weight_rows, dim), row r
 * uses weight row r % weight_rows. All float32 or all bf16. */
void rms_norm(const void *x, int64_t group_stride, int group_rows, const void *weight, int weight_rows, void *out,
              int64_t rows, int dim, float eps, int is_bf16) {
    normalise(x, group_stride, group_rows, weight, weight_rows, NULL, NULL, out, rows, dim, eps, is_bf16);
}

/* As rms_norm, then the rotary embedding of each row in place of the four to five torch ops
 * apply_rotary takes (a layer's q and k heads: one call instead of six, every layer of every
 * step). Row r belongs to token r / group_rows; cos and signed_sin: (tokens, dim), contiguous, the
 * half-split tables RotaryEmbedding builds, (cos, cos) and (-sin, sin). */
void rms_norm_rope(const void *x, int64_t group_stride, int group_rows, const void *weight, int weight_rows,
                   const void *cos, const void *signed_sin, void *out, int64_t rows, int dim, float eps,
                   int is_bf16) {
    normalise(x, group_stride, group_rows, weight, weight_rows, cos, signed_sin, out, rows, dim, eps, is_bf16);
}
