/* y = x W^T for up to a few dozen rows of x on AMX tiles, reading the weights in place.
 *
 * A decode step of 8 to 64 sequences still only streams the weights once, but it is too much
 * arithmetic for AVX-512 dot products (small_batch_linear.c) and oneDNN reads the weights at about
 * two thirds of memory speed there. A short prompt's prefill (a few dozen to a hundred-odd rows)
 * is arithmetic-bound, and there oneDNN re-blocks the plain weights at every call; this kernel
 * keeps a block of 32 weight rows in cache while every group of 32 input rows passes over it,
 * and ran the 0.6B model's matmuls at 128 rows in 0.68-0.83x oneDNN's time.
 * AMX multiplies a 16 x 32 bf16 tile by a 32 x 16 one per instruction. The weights take the A
 * side, straight from their plain (N, K) layout: a tile is 16 weight rows of 32 values. The
 * activations take the B side, which AMX wants in pairs along K ("VNNI"); they are small, so they
 * are repacked once per call. The result comes out transposed (output columns by input rows) and
 * is written back row-major, rounded to bf16 once, to nearest even, as torch rounds.
 *
 * Built only where the compiler targets AMX-BF16; amx_linear_supported() also asks the kernel for
 * the tile state (Linux's arch_prctl), which a process must do once before using AMX.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "amx_tiles.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>

#define CHUNK 32  /* up to this many input rows (one pair of 16-row groups), tiles sized to the rows */
/* Steps along K that each weight row is fetched ahead of its tile load. A tile load takes 64 bytes
 * from each of 16 rows, kilobytes apart: the hardware prefetcher does not run ahead on that, and
 * streaming the 0.6B model's weights at 16 rows took 57-63 ms with this prefetch against 65-76 ms
 * without (1 to 4 steps ahead measured alike). */
#define PREFETCH_STEPS 2

int amx_linear_supported(void) { return request_tile_state(); }

/* Input rows, in groups of 16, per pass over the weights. Up to this many, a block of weights is
 * read from memory once; their packed copy (rows x K x 2 bytes, 768 KB at 128 rows of the 0.6B
 * model's widest input) still sits in L2 beside the weight block it meets. */
#define PASS_ROWS 256

/* x: (m, k) bf16; w: (n, k) bf16; out: (m, n) bf16. n and k multiples of 32. Returns 0, or -1.
 *
 * x is packed once, in pairs of 16-row groups (zero rows pad the last pair), and each thread takes
 * whole blocks of 32 weight rows. A block is fetched from memory by the first group pair that
 * meets it, which (from three pairs) also copies it in tile order, and the other pairs read that
 * copy from L2. Up to
 * CHUNK rows (a decode batch) there is one pair, and the tiles are sized to its rows so that 3 rows
 * cost 3 rows' arithmetic; more rows (a short prefill) use whole tiles, and a pair's second group
 * only when it holds rows. */
int amx_linear(const uint16_t *x, const uint16_t *w, uint16_t *out, int m, int64_t n, int64_t k) {
    if (n % 32 || k % 32) return -1;
    const int64_t steps = k / 32;
    const int64_t groups = ((m + 31) / 32) * 2;
    uint32_t *packed = aligned_alloc(64, (size_t)groups * steps * 256 * sizeof(uint32_t));
    if (!packed) return -1;
    const int tile_rows0 = m <= CHUNK ? group_rows(m, 0) : 16;
    const int tile_rows1 = m <= CHUNK ? group_rows(m, 16) : 16;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int rows = group_rows(m, g * 16);
            if (rows) /* a group without rows pads a pair and is never loaded */
                pack_rows(x, packed + g * steps * 256, (int)(g * 16), rows, k);
        }
        configure(tile_rows0, tile_rows1 ? tile_rows1 : 1);
        float c[4][256] __attribute__((aligned(64)));
        /* The weight block in tile order, for a pass with three group pairs or more. With two (33-64
         * rows), copying it for one more pass took as long as it saved: 0.68-0.75x oneDNN's time
         * at 64 rows either way, measured in turns with the kernel that never copied. */
        uint16_t *pack = groups > 4 ? aligned_alloc(64, (size_t)steps * 2048) : NULL;
        for (int64_t first = 0; first < groups; first += PASS_ROWS / 16) {
            const int64_t last = first + PASS_ROWS / 16 < groups ? first + PASS_ROWS / 16 : groups;
#pragma omp for schedule(static)
            for (int64_t n0 = 0; n0 < n; n0 += 32) {
                const uint16_t *w0 = w + n0 * k, *w1 = w + (n0 + 16) * k;
                const int repacked = pack && last - first > 4;
                for (int64_t g = first; g < last; g += 2) {
                    const uint32_t *b0 = packed + g * steps * 256, *b1 = b0 + steps * 256;
                    const int m0 = (int)(g * 16), rows0 = group_rows(m, m0), rows1 = group_rows(m, m0 + 16);
                    if (g == first && repacked)
                        tile_block(w0, w1, k * 2, 32, pack, b0, b1, steps, rows0, rows1, PREFETCH_STEPS, c, out, n0,
                                   n, m0);
                    else if (g == first)
                        tile_block(w0, w1, k * 2, 32, NULL, b0, b1, steps, rows0, rows1, PREFETCH_STEPS, c, out, n0,
                                   n, m0);
                    else if (repacked)
                        tile_block(pack, pack + 512, 64, 1024, NULL, b0, b1, steps, rows0, rows1, 0, c, out, n0, n,
                                   m0);
                    else
                        tile_block(w0, w1, k * 2, 32, NULL, b0, b1, steps, rows0, rows1, 0, c, out, n0, n, m0);
                }
            }
        }
        _tile_release();
        free(pack);
    }
    free(packed);
    return 0;
}

#else

int amx_linear_supported(void) { return 0; }

int amx_linear(const uint16_t *x, const uint16_t *w, uint16_t *out, int m, int64_t n, int64_t k) {
    (void)x, (void)w, (void)out, (void)m, (void)n, (void)k;
    return -1;
}

#endif
