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

static inline float load(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* x: groups of `group_rows` contiguous rows of `dim` values, group g at x + g * group_stride
 * (elements), e.g. a token's heads; out: contiguous (rows, dim); weight: (weight_rows, dim), row r
 * uses weight row r % weight_rows. All float32 or all bf16. */
void rms_norm(const void *x, int64_t group_stride, int group_rows, const void *weight, int weight_rows, void *out,
              int64_t rows, int dim, float eps, int is_bf16) {
#pragma omp parallel for schedule(static) if (rows * dim > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r / group_rows * group_stride + r % group_rows * (int64_t)dim;
        const int64_t w_base = (r % weight_rows) * (int64_t)dim;
        float sum = 0.0f;
        for (int d = 0; d < dim; d++) {
            const float v = load(x, base + d, is_bf16);
            sum += v * v;
        }
        const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int d = 0; d < dim; d++) {
            const float normed = load(x, base + d, is_bf16) * scale;
            const float w = load(weight, w_base + d, is_bf16);
            if (is_bf16) ((uint16_t *)out)[r * dim + d] = f32_to_bf16(w * bf16_to_f32(f32_to_bf16(normed)));
            else ((float *)out)[r * dim + d] = w * normed;
        }
    }
}

/* As rms_norm, then the rotary embedding of each row in place of the four to five torch ops
 * apply_rotary takes (a layer's q and k heads: one call instead of six, every layer of every
 * step). Row r belongs to token r / group_rows; cos and signed_sin: (tokens, dim), contiguous, the
 * half-split tables RotaryEmbedding builds, (cos, cos) and (-sin, sin). Each product and the sum
 * are rounded to the model dtype in turn, as the torch ops do. */
void rms_norm_rope(const void *x, int64_t group_stride, int group_rows, const void *weight, int weight_rows,
                   const void *cos, const void *signed_sin, void *out, int64_t rows, int dim, float eps,
                   int is_bf16) {
    const int half = dim / 2;
#pragma omp parallel for schedule(static) if (rows * dim > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r / group_rows * group_stride + r % group_rows * (int64_t)dim;
        const int64_t w_base = (r % weight_rows) * (int64_t)dim;
        const int64_t t_base = r / group_rows * (int64_t)dim;
        float normed[dim];
        float sum = 0.0f;
        for (int d = 0; d < dim; d++) {
            const float v = load(x, base + d, is_bf16);
            sum += v * v;
        }
        const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
        for (int d = 0; d < dim; d++) {
            const float n = load(x, base + d, is_bf16) * scale;
            const float w = load(weight, w_base + d, is_bf16);
            normed[d] = is_bf16 ? bf16_to_f32(f32_to_bf16(w * bf16_to_f32(f32_to_bf16(n)))) : w * n;
        }
        for (int d = 0; d < dim; d++) {
            const float rotated = normed[d < half ? d + half : d - half];
            /* volatile: each product rounded on its own, never fused into one multiply-add. */
            volatile float a = normed[d] * load(cos, t_base + d, is_bf16);
            volatile float b = rotated * load(signed_sin, t_base + d, is_bf16);
            if (is_bf16) {
                a = bf16_to_f32(f32_to_bf16(a));
                b = bf16_to_f32(f32_to_bf16(b));
                ((uint16_t *)out)[r * dim + d] = f32_to_bf16(a + b);
            } else {
                ((float *)out)[r * dim + d] = a + b;
            }
        }
    }
}
