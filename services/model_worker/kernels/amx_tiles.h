/* AMX tile helpers shared by the CPU kernels (amx_linear.c, q8_linear.c, w8a8_linear.c,
 * prefill_attention.c): the tile state, the tile configuration, the activations packed as B tiles,
 * and a result tile written back as bf16 rows. */
#ifndef VLLM_V0_AMX_TILES_H
#define VLLM_V0_AMX_TILES_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "transpose.h"

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 1 once Linux grants this process the tile state (arch_prctl), which it must ask for once before
 * any tile instruction; 0 where it refuses. */
static inline int request_tile_state(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

/* Tiles 0-3: results (two 16-column stretches of the output by two groups of input rows);
 * 4-5: the two weight tiles; 6-7: the two activation groups. At (16, 16) every tile is 16 rows of
 * 64 bytes. */
static void configure(int rows0, int rows1) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    const int group_rows[2] = {rows0, rows1};
    for (int n = 0; n < 2; n++) {
        for (int g = 0; g < 2; g++) {
            cfg.rows[n * 2 + g] = 16;
            cfg.colsb[n * 2 + g] = (uint16_t)(group_rows[g] * 4);
        }
        cfg.rows[4 + n] = 16;
        cfg.colsb[4 + n] = 64;
    }
    for (int g = 0; g < 2; g++) {
        cfg.rows[6 + g] = 16;
        cfg.colsb[6 + g] = (uint16_t)(group_rows[g] * 4);
    }
    /* GCC does not count ldtilecfg as a read of cfg: without this barrier it dropped the row and
     * column stores above as dead, and the first tile instruction faulted. */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

/* Input rows [m0, m0 + rows) of x (M, K) as B tiles: for each 32-wide step along K, 16 pairs by
 * 16 rows, a pair being two consecutive K values of one row (one 32-bit word); rows past `rows`
 * are zeros. A step is one 16 x 16 transpose of 32-bit words: written element by element, the
 * packing put each store on a new cache line and cost 20-75 us a call, more than a small
 * matmul's arithmetic. */
static void pack_rows(const uint16_t *x, uint32_t *packed, int m0, int rows, int64_t k) {
    const int64_t steps = k / 32;
    for (int64_t s = 0; s < steps; s++) {
        __m512i v[16];
        for (int j = 0; j < 16; j++)
            v[j] = j < rows ? _mm512_loadu_si512(x + (int64_t)(m0 + j) * k + s * 32) : _mm512_setzero_si512();
        transpose16(v);
        for (int p = 0; p < 16; p++) _mm512_store_si512(packed + (s * 16 + p) * 16, v[p]);
    }
}

/* A result tile c (16 output columns by `rows` input rows) into out's rows m0.., columns n0..n0+15:
 * the tile is transposed in registers, and each input row's 16 values are rounded to bf16 (nearest
 * even) and stored. (A gather per column took 1-3% longer over a 128-row prefill's matmuls.) */
static void write_out(const float *c, uint16_t *out, int rows, int64_t n0, int64_t n, int m0) {
    __m512i v[16];
    for (int j = 0; j < 16; j++) v[j] = _mm512_load_si512(c + j * 16);
    transpose16(v);
    for (int j = 0; j < rows; j++)
        _mm256_storeu_si256((__m256i *)(out + (int64_t)(m0 + j) * n + n0), (__m256i)_mm512_cvtneps_pbh((__m512)v[j]));
}

/* Rows of x from m0 in a group of 16: 16, fewer in the last group, 0 in the padding group. */
static int group_rows(int64_t m, int64_t m0) {
    return m - m0 >= 16 ? 16 : (m > m0 ? (int)(m - m0) : 0);
}

/* One output block: 32 weight rows against one or two groups of 16 packed input rows (b0, b1; b1
 * unused when rows1 is 0), accumulated over `steps` 32-column steps in tiles 0-3 and written to out at
 * columns n0..n0+31, rows m0... The weights come as two tiles of 16 rows per step (w0, w1): in place,
 * a tile's rows are `stride` bytes apart (2 k) and a step moves `step` = 32 values along them; in the
 * packed copy below, a step's two tiles are 1 KB each and contiguous (stride 64, step 1024, w1 = w0 +
 * 512). `prefetch` > 0 pulls in-place weight rows that many steps ahead into cache (for weights
 * streamed from memory rather than a cache-resident copy). A non-NULL `pack_to` receives that copy:
 * later passes over the block then load 1 KB contiguous tiles, not 16 rows kilobytes apart, which ran
 * a 128-row prefill's matmuls in about 0.9x the time. Always inlined, so that each call site's
 * constant stride, step and pack_to fold into its loop (left to a runtime choice, the same code ran
 * about 5% slower). */
static inline __attribute__((always_inline)) void
tile_block(const uint16_t *w0, const uint16_t *w1, int64_t stride, int64_t step, uint16_t *pack_to,
           const uint32_t *b0, const uint32_t *b1, int64_t steps, int rows0, int rows1, int prefetch,
           float c[4][256], uint16_t *out, int64_t n0, int64_t n, int m0) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        if (prefetch && s + prefetch < steps)
            for (int r = 0; r < 32; r++)
                _mm_prefetch((const char *)(w0 + (s + prefetch) * step) + r * stride, _MM_HINT_T0);
        _tile_loadd(4, w0 + s * step, stride);
        _tile_loadd(5, w1 + s * step, stride);
        if (pack_to) {
            _tile_stored(4, pack_to + s * 1024, 64);
            _tile_stored(5, pack_to + s * 1024 + 512, 64);
        }
        _tile_loadd(6, b0 + s * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (rows1) {
            _tile_loadd(7, b1 + s * 256, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(2, c[2], 64);
    write_out(c[0], out, rows0, n0, n, m0);
    write_out(c[2], out, rows0, n0 + 16, n, m0);
    if (rows1) {
        _tile_stored(1, c[1], 64);
        _tile_stored(3, c[3], 64);
        write_out(c[1], out, rows1, n0, n, m0 + 16);
        write_out(c[3], out, rows1, n0 + 16, n, m0 + 16);
    }
}


/* A 2 x 2 block of tile products over steps of 32 inputs: result tile 2a + b accumulates A tile 4 + a
 * times B tile 6 + b, for the A tiles in use (5 too with two_a) and the B tiles (7 too with two_b). A
 * tiles are 16 rows astride bytes apart, B tiles contiguous kilobytes; step s's tiles sit s * astep
 * and s * bstep bytes on from a0, a1 and b0, b1.
 *
 * load_first_tiles loads step 0's tiles. step_products runs step s's products and, unless s is the
 * last step, loads each tile with step s + 1's right after the last product reading it. Tiles are not
 * renamed: a load waits for the products issued before it that read the tile, so loading all of a
 * step's tiles at its top left the tile unit waiting on them every step. In this order the 0.6B
 * model's matmuls (vnni_linear.c) took 0.89-0.90x the time and its prompt attention
 * (prefill_attention.c) 0.95-0.99x; running the two products that share a B tile first did worse
 * (docs/served-speed.md, item 27). Always inlined, so each call site's constants fold. */
typedef struct {
    const char *a0, *a1, *b0, *b1;
    int64_t astride, astep, bstep;
    int two_a, two_b;
    int stream; /* load with TILELOADDT1 (tile_load below) */
} tile_steps;

/* A tile load; with `stream`, TILELOADDT1, which tells the core the rows will not be read again soon, so
 * they do not push out of L1 what will (vnni_linear.c: the results it reads back, the rows it writes). */
#define tile_load(t, tile, base, stride)                     \
    do {                                                     \
        if ((t)->stream) _tile_stream_loadd(tile, base, stride); \
        else _tile_loadd(tile, base, stride);                \
    } while (0)

static inline __attribute__((always_inline)) void load_first_tiles(const tile_steps *t) {
    tile_load(t, 4, t->a0, t->astride);
    if (t->two_a) tile_load(t, 5, t->a1, t->astride);
    tile_load(t, 6, t->b0, 64);
    if (t->two_b) tile_load(t, 7, t->b1, 64);
}

static inline __attribute__((always_inline)) void step_products(const tile_steps *t, int64_t s, int64_t steps) {
    const int more = s + 1 < steps;
    const int64_t a = (s + 1) * t->astep, b = (s + 1) * t->bstep;
    _tile_dpbf16ps(0, 4, 6);
    if (t->two_b) _tile_dpbf16ps(1, 4, 7);
    if (more) tile_load(t, 4, t->a0 + a, t->astride);
    if (t->two_a) {
        _tile_dpbf16ps(2, 5, 6);
        if (more) tile_load(t, 6, t->b0 + b, 64);
        if (t->two_b) _tile_dpbf16ps(3, 5, 7);
        if (more) {
            if (t->two_b) tile_load(t, 7, t->b1 + b, 64);
            tile_load(t, 5, t->a1 + a, t->astride);
        }
    } else if (more) {
        tile_load(t, 6, t->b0 + b, 64);
        if (t->two_b) tile_load(t, 7, t->b1 + b, 64);
    }
}

#endif

#endif
