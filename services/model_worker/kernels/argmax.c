/* Greedy decoding's argmax over the vocabulary, one row per sequence, for bf16 or float32 logits.
 *
 * torch's argmax reads bf16 logits at well under a tenth of memory speed on this CPU (about 6 ms
 * for 16 rows of 151,936 against the 0.3 ms reading them takes). Same answer as torch.argmax:
 * the first index of the largest value, a NaN counting as largest (the first NaN wins).
 */
#include <stdint.h>

#include "row_argmax.h"

/* x: rows of n values, row r at x + r * row_stride (elements); out: (rows,) indices. */
void argmax_rows(const void *x, int64_t rows, int64_t n, int64_t row_stride, int is_bf16, int64_t *out) {
    const int64_t size = is_bf16 ? 2 : 4;
#pragma omp parallel for schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) out[r] = row_argmax((const char *)x + r * row_stride * size, n, is_bf16);
}
