/* The sampler's counter-based draws on the CPU: the same uniforms as executor/random_draws.py's torch path
 * (bit for bit), in one pass instead of its ~25 (each a trip through memory and a dispatch), and their
 * exponential variates -log(u) with a log of its own: torch's float32 log took 4.6 ns a value here, this
 * pass 0.5 ns for both.
 *
 * Row r's words are (s0, s1, w): its seed's two 32-bit words and counter * NUM_STREAMS + stream. Its keys
 * are k_i = lowbias32(s_i ^ w); token t's value is h = lowbias32(lowbias32(t ^ k0) ^ k1), and the uniform
 * ((h >> 8) | 1) / 2**24, exact in float32. Unsigned 32-bit arithmetic wraps by definition, as the torch
 * path's masked int64 products do.
 *
 * race_rows is the sampler's whole draw in one pass over each row: the argmax over tokens of
 * exp(c_t - max) / E_t, where torch took six passes and five temporaries of the row's width.
 */
#include <stdint.h>
#include <string.h>

#include "row_argmax.h"

static inline uint32_t lowbias32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

/* -log(u) for u in (0, 1): FreeBSD's e_logf.c (as in musl) without its special cases, which no u here
 * needs; branch-free, so the vectorised loop and its scalar remainder compute the same bits. Under 1 ulp,
 * and accurate relative to the result near u = 1, where the smallest variates come from. */
static inline float neg_log(float u) {
    const float ln2_hi = 6.9313812256e-01f, ln2_lo = 9.0580006145e-06f;
    const float lg1 = 0xaaaaaa.0p-24f, lg2 = 0xccce13.0p-25f, lg3 = 0x91e9ee.0p-25f, lg4 = 0xf89e26.0p-26f;
    uint32_t bits;
    memcpy(&bits, &u, sizeof bits);
    /* u = 2**k * x with x in [sqrt(2)/2, sqrt(2)): f = x - 1 is exact. */
    bits += 0x3f800000U - 0x3f3504f3U;
    const int32_t k = (int32_t)(bits >> 23) - 0x7f;
    bits = (bits & 0x007fffffU) + 0x3f3504f3U;
    float x;
    memcpy(&x, &bits, sizeof x);
    const float f = x - 1.0f;
    const float s = f / (2.0f + f);
    const float z = s * s;
    const float w = z * z;
    const float r = z * (lg1 + w * lg3) + w * (lg2 + w * lg4);
    const float hfsq = 0.5f * f * f;
    const float dk = (float)k;
    return -(s * (hfsq + r) + dk * ln2_lo - hfsq + f + dk * ln2_hi);
}

/* Each row's words (s0, s1, w) from its seed and counter: the seed's SplitMix64 output split in two, and
 * counter * NUM_STREAMS + stream, each mod 2**32 (executor/random_draws.py's seed_words and draw_words, whose
 * per-row Python took about 0.5 us a row). seeds: (rows,) 64-bit seeds as int64 bits; out: (rows, 3) int64. */
void words_rows(const int64_t *seeds, const int64_t *counters, int64_t stream, int64_t num_streams, int64_t rows,
                int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        uint64_t z = (uint64_t)seeds[r] + 0x9e3779b97f4a7c15ULL;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
        z ^= z >> 31;
        out[3 * r] = (int64_t)(z & 0xffffffffU);
        out[3 * r + 1] = (int64_t)(z >> 32);
        out[3 * r + 2] = (int64_t)(((uint64_t)counters[r] * (uint64_t)num_streams + (uint64_t)stream) & 0xffffffffU);
    }
}

#define COLUMN_BLOCK 4096

/* words: (rows, 3) int64; ids: token ids, row r's at ids + r * ids_row_stride (0: one row shared);
 * out: (rows, width) float32, contiguous: uniforms, or their exponential variates when `exponential`. */
void draw_rows(const int64_t *words, const int64_t *ids, int64_t ids_row_stride, int64_t rows, int64_t width,
               int exponential, float *out) {
    const int64_t blocks = (width + COLUMN_BLOCK - 1) / COLUMN_BLOCK;
/* Threads only for work worth far more than waking them (about 0.5 ns a value). */
#pragma omp parallel for collapse(2) schedule(static) if (rows * width > (1 << 20))
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < blocks; b++) {
            const uint32_t w = (uint32_t)words[3 * r + 2];
            const uint32_t k0 = lowbias32((uint32_t)words[3 * r] ^ w);
            const uint32_t k1 = lowbias32((uint32_t)words[3 * r + 1] ^ w);
            const int64_t *row_ids = ids + r * ids_row_stride;
            float *row_out = out + r * width;
            const int64_t start = b * COLUMN_BLOCK;
            const int64_t end = start + COLUMN_BLOCK < width ? start + COLUMN_BLOCK : width;
            for (int64_t i = start; i < end; i++) {
                const uint32_t h = lowbias32(lowbias32((uint32_t)row_ids[i] ^ k0) ^ k1);
                row_out[i] = (float)((h >> 8) | 1U) * 0x1p-24f;
            }
            if (exponential) {
                for (int64_t i = start; i < end; i++) row_out[i] = neg_log(row_out[i]);
            }
        }
    }
}

/* The row's keys from its words (s0, s1, w). */
static inline void row_keys(const int64_t *words, uint32_t *k0, uint32_t *k1) {
    const uint32_t w = (uint32_t)words[2];
    *k0 = lowbias32((uint32_t)words[0] ^ w);
    *k1 = lowbias32((uint32_t)words[1] ^ w);
}

/* Token id's exponential variate -log(u) under the row's keys. */
static inline float variate(uint32_t id, uint32_t k0, uint32_t k1) {
    const uint32_t h = lowbias32(lowbias32(id ^ k0) ^ k1);
    return neg_log((float)((h >> 8) | 1U) * 0x1p-24f);
}

/* exp(d) for d in [-87, 0] (a normal result): Cephes' expf, d = n ln2 + r with |r| <= ln2 / 2, a degree-6
 * polynomial for exp(r), and 2**n from its exponent bits. Within about 1 ulp, like torch's; branch-free, so
 * the loop vectorises. */
static inline float exp_nonpositive(float d) {
    const float shifter = 12582912.0f; /* 1.5 * 2**23: adding it rounds to an integer, held in the low bits */
    const float t = d * 1.44269504088896341f + shifter;
    const float n = t - shifter;
    int32_t ni;
    memcpy(&ni, &t, sizeof ni);
    ni -= 0x4b400000;
    const float r = (d - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t scale_bits = (uint32_t)(ni + 127) << 23;
    float scale;
    memcpy(&scale, &scale_bits, sizeof scale);
    return p * scale;
}

/* Below this a token's weight is 0: its probability relative to the top token's is under 2**-125, and -inf
 * (a masked token) lands here too. */
#define RACE_FLOOR (-87.0f)

/* The exponential race over each row's candidates: out[r] = the column of the largest exp(x - max) / E over
 * x = c / temperature[r], E = -log(u) the token's variate for the row's words, the first among equal weights, as
 * torch's argmax. c: (rows, width) bf16 or float32, row r at c + r * c_row_stride (elements), -inf where masked
 * out; temperature: (rows,) float32, NULL for none (x = c); ids: the columns' token ids, row r's at
 * ids + r * ids_row_stride (0: one row shared), NULL: the column is the token id.
 * x is torch's float32 quotient, and max(c) / t is max(x) exactly, as rounding keeps order. A row whose max is
 * NaN or infinite (a NaN weight somewhere, as in torch's arithmetic) answers its first NaN weight's column, 0
 * where every weight is NaN. */
void race_rows(const void *c, int is_bf16, int64_t c_row_stride, const float *temperature, const int64_t *words,
               const int64_t *ids, int64_t ids_row_stride, int64_t rows, int64_t width, int64_t *out) {
    const int64_t size = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (rows * width > (1 << 20))
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)c + r * c_row_stride * size;
        const int64_t *row_ids = ids ? ids + r * ids_row_stride : 0;
        const float t = temperature ? temperature[r] : 1.0f;
        int has_nan = 0;
        const float top = row_max(row, width, is_bf16, &has_nan) / t;
        uint32_t k0, k1;
        row_keys(words + 3 * r, &k0, &k1);
        float x[COLUMN_BLOCK], weights[COLUMN_BLOCK];
        float best = -1.0f;
        int64_t chosen = 0;
        for (int64_t start = 0; start < width; start += COLUMN_BLOCK) {
            const int64_t n = width - start < COLUMN_BLOCK ? width - start : COLUMN_BLOCK;
            /* Each a loop of its own, not one with selects: GCC vectorised the id select with masked loads through
             * the NULL pointer, which took about 10 ns a value here (AMD EPYC), 13 times the whole race. */
            if (is_bf16) {
                const uint16_t *half = (const uint16_t *)row + start;
                for (int64_t i = 0; i < n; i++) x[i] = bf16_to_f32(half[i]) / t;
            } else {
                const float *full = (const float *)row + start;
                for (int64_t i = 0; i < n; i++) x[i] = full[i] / t;
            }
            if (row_ids) {
                for (int64_t i = 0; i < n; i++) weights[i] = variate((uint32_t)row_ids[start + i], k0, k1);
            } else {
                for (int64_t i = 0; i < n; i++) weights[i] = variate((uint32_t)(start + i), k0, k1);
            }
            for (int64_t i = 0; i < n; i++) {
                const float d = x[i] - top;
                /* d < floor is false for a NaN d, which stays NaN through the polynomial, as torch's exp keeps it */
                weights[i] = d < RACE_FLOOR ? 0.0f : exp_nonpositive(d) / weights[i];
            }
            const int64_t i = row_argmax(weights, n, 0);
            const float v = weights[i];
            if (v != v) {
                chosen = start + i;
                break;
            }
            if (v > best) {
                best = v;
                chosen = start + i;
            }
        }
        out[r] = chosen;
    }
}
