/* The sampler's counter-based draws on the CPU: the same uniforms as executor/random_draws.py's torch path
 * (bit for bit), in one pass instead of its ~25 (each a trip through memory and a dispatch), and their
 * exponential variates -log(u) with a log of its own: torch's float32 log took 4.6 ns a value here, this
 * pass 0.5 ns for both.
 *
 * Row r's words are (s0, s1, w): its seed's two 32-bit words and counter * NUM_STREAMS + stream. Its keys
 * are k_i = lowbias32(s_i ^ w); token t's value is h = lowbias32(lowbias32(t ^ k0) ^ k1), and the uniform
 * ((h >> 8) | 1) / 2**24, exact in float32. Unsigned 32-bit arithmetic wraps by definition, as the torch
 * path's masked int64 products do.
 */
#include <stdint.h>
#include <string.h>

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
