/* y = x W^T at every row count, with W held in the order AMX reads it: the bf16 matmuls of a CPU with AMX.
 *
 * The layout ("VNNI"): W (n, k) is held as (n / 16, k / 2, 16, 2). For each block of 16 output rows,
 * each pair of consecutive inputs of its 16 rows sits side by side in one 64-byte line, so one
 * 32-input step of a block is one contiguous 1 KB tile in the form AMX takes its B operand in.
 * vnni_pack reorders a weight into it, in place.
 *
 * Why hold it so. amx_linear.c reads the plain (n, k) weight: its 16-row tiles are 16 lines kilobytes
 * apart, it packs the activations and copies each weight block once per call, and its results come
 * out transposed. Here the weights are the B side and the activations the A side, straight from x
 * (16 rows of 32 inputs): results come out row-major, and a tile is one contiguous kilobyte. Each
 * block pair's results are written out while the next pair's tiles multiply (block_product). Over
 * the 0.6B model's matmuls, layer by layer in turns with oneDNN on the plain weight, the same
 * arithmetic (the same bits) took 0.59x oneDNN's time at 64 rows against amx_linear's 0.67x, 0.68x
 * at 128 against 0.82x, 0.76x at 256 against 0.90x, and 0.93x and 0.94x at 512 and 768 rows, where
 * amx_linear took 1.09x and 1.15x; oneDNN on its own reordered copy took 0.70x, 0.75x, 0.82x, 0.94x
 * and 0.95x (bench/bench_prefill_matmul.py). Before, with each pair's results written after its own
 * products and passes of 256 rows throughout, this kernel took 1.01x and 1.18x at 512 and 768 rows.
 *
 * vnni_linear_silu is the MLP's gate/up matmul with its activation: each AMX block pair is a gate
 * block and the up block of the same outputs, and F.silu(gate) * up is written from the result tiles,
 * so the (m, 2 x intermediate) product is never written or read back and the SiLU runs beside the tile
 * products. Over the 0.6B model's 28 gate/up weights it took 0.87x, 0.86x, 0.86x and 0.95x the time
 * of vnni_linear and decoder.c's silu_and_mul at 32, 128, 512 and 768 rows (bench/bench_swiglu.py).
 * Without AMX, past RT_WIDE_MAX rows the register tiles do the same, over groups of two gate blocks and
 * their two up blocks: on one core of AMD's Zen 4, 0.97x the two passes' time at 32-512 rows, 0.98-0.99x
 * at 1,024-2,048 (the SiLU's own arithmetic stays; what goes is the product's trip through memory).
 *
 * One or two rows (a decode step of one or two sequences) only stream the weights: AVX512-BF16
 * multiplies each 64-byte line by a broadcast input pair, 16 outputs at once, with ONE_ROW_BLOCKS
 * blocks in flight (8 on Xeons with AMX, one on Zen 4), each a contiguous stream prefetched
 * PREFETCH_STEPS tiles ahead (two rows on AMX: TWO_ROW_PREFETCH_STEPS). Each output accumulates its
 * input pairs in order in float32 and is rounded to bf16 once, to nearest even, as torch rounds. (On
 * a Xeon, a loop over 16-row tiles of the plain weight, one or two streams, took 1.14-1.23x
 * small_batch_linear's time; this one took 1.00x at one row and 0.90x at two, on the 0.6B model.)
 * Three rows and more go to AMX, whose tile products add
 * each output's input pairs in the same order as amx_linear's (the same bits, tested), or without AMX
 * to AVX512-BF16 register tiles (avx512_rows), which add them in the same order too. A decode step of
 * 3-16 rows loads each input tile once for four weight blocks (quad_product), the same products in the
 * same order: with the rows read in place a tile's 16 lines are kilobytes apart, and loading them for
 * every two weight tiles cost a decode step about a millisecond a row beside the weight stream. In the
 * engine's decode steps on one core of a Xeon with AMX: 10 / 14 / 16 sequences in 0.97x / 0.88x /
 * 0.92x the time; with the weight tiles pulled one step ahead (DECODE_PREFETCH_STEPS), 3 / 4 / 5 / 6 /
 * 8 / 9 in 0.99x / 0.98x / 0.97x / 0.96x / 0.97x / 0.96x (two steps ahead, 3-4 had taken 1.04-1.06x).
 *
 * Built where the compiler targets AVX512-BF16, with the AMX paths where it targets AMX-BF16 too; there
 * vnni_linear_supported() also asks the kernel for the tile state (Linux's arch_prctl).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "amx_tiles.h"
#include "l2_share.h"
#include "silu.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define VNNI_AMX 1
#endif

/* 16-output blocks in flight for one row. On Xeons with AMX: 8 (4 streamed alike, 16 slower). On AMD's
 * Zen 4 (no AMX), one block at a time, so each thread reads one stream straight through: over the 0.6B
 * model's 112 decoder weights on one core, the fastest of seven passes took 30-35 ms (25-29 GB/s) against
 * 66-74 ms with 8 blocks, 48-53 ms with 4 and 41 ms with 2 (1 to 16 tiles ahead: alike): a core there
 * streams one run of consecutive lines fastest. */
#ifdef VNNI_AMX
#define ONE_ROW_BLOCKS 8
#else
#define ONE_ROW_BLOCKS 1
#endif
/* For two rows: 4 on Xeons with AMX (8 accumulators); one on Zen 4, as ONE_ROW_BLOCKS (two rows over the
 * 112 weights: 48 ms against 60 ms with 4, medians of five passes in turns). */
#ifdef VNNI_AMX
#define TWO_ROW_BLOCKS 4
#else
#define TWO_ROW_BLOCKS 1
#endif
#define PREFETCH_STEPS 2  /* 1 KB tiles ahead: 0, 1, 4 and 8 streamed slower */
/* two_rows' tiles ahead. On Xeons with AMX its four streams, each line taking twice one_row's products,
 * do best four tiles ahead: the engine's two-sequence decode steps (one core) took 0.91x and 0.94x the time
 * of two tiles ahead (two runs of seven rounds), where one_row with four took 1.03-1.05x and keeps two.
 * Zen 4 (one stream) keeps PREFETCH_STEPS: four was not measured there. */
#ifdef VNNI_AMX
#define TWO_ROW_PREFETCH_STEPS 4
#else
#define TWO_ROW_PREFETCH_STEPS PREFETCH_STEPS
#endif
/* The AMX path's weight tiles ahead at up to 32 rows (a decode step, the input read in place). One
 * rather than two: in the engine's decode steps on a Xeon with AMX (480 MB of L3, one core),
 * 3 / 8 / 12 / 16 sequences took 0.975x / 1.00x / 0.96x / 0.97x the time; 0 and a second prefetch
 * 4 or 8 tiles ahead into L2 took longer. */
#define DECODE_PREFETCH_STEPS 1
/* Input rows per pass over the weights: as many groups of 32 as keep their tiles (64 k bytes a group)
 * within PASS_BYTES, half of a core's L2 here, from 64 rows to 512 (PASS_MAX_PAIRS). (With passes of up
 * to 256 rows, the down projection's 3,072 inputs in passes of 160 rows took 0.96x and 0.97x the time at
 * 512 and 768 rows; budgets of 768 KB and 1.25 MB did no better.)
 *
 * Every pair of a pass, at every step of a block, pulls a share of the thread's next block into L2
 * (prefetch_share), so that block's first pair finds it there instead of streaming it from memory while
 * the tile unit waits. Over the 0.6B model's four matmuls, in turns: 0.92-0.97x the time at 64-128 rows.
 * At first the pulls stopped at passes of four pairs (in a C loop, 1.08-1.34x the time from 192 rows),
 * and passes of eight went without them. Prompts in the engine on a Xeon with AMX (one core), in turns
 * with that (256-row passes, no pulls from 192 rows), at 256 / 512 / 768 tokens: 128-row passes with the
 * pulls 0.94x / 0.975x / 0.97x the time; 256-row passes with them 0.94x / 0.96x / 0.97x against the
 * 128-row ones; and up to 512 rows 1.00x / 0.976x / 0.978x against 256. Passes of 64 or 96 rows, of 128
 * without the pulls, or 2 MB of inputs a pass took longer. What is left at 128 rows:
 * docs/served-speed.md, item 28. */
#define PASS_BYTES (1 << 20)
#define PASS_MAX_PAIRS 16

#ifdef VNNI_AMX
int vnni_linear_supported(void) { return request_tile_state(); }
#else
int vnni_linear_supported(void) { return 1; }
#endif

/* Pull into cache the 16 lines of the tile `ahead` steps on: in this block, or past its end in the block
 * this thread reads next, `next` values on (so a new block does not start on a miss). Always inlined:
 * as a call it clobbered the loop's sixteen broadcast inputs (vector registers are the caller's to
 * save), and one row took 1.2x the time. */
static inline __attribute__((always_inline)) void prefetch_tile(const uint16_t *tile, int64_t s, int64_t steps,
                                                                int ahead, int64_t next) {
    const uint16_t *at = s + ahead < steps ? tile + ahead * 512 : tile + next + (ahead - steps) * 512;
    for (int l = 0; l < 16; l++) _mm_prefetch((const char *)at + l * 64, _MM_HINT_T0);
}

/* Blocks per parallel chunk: `most`, halved while there are fewer than four chunks per thread (so many
 * cores still share a narrow layer). */
static int64_t blocks_per_chunk(int64_t blocks, int most) {
    int64_t b = most;
    while (b > 1 && blocks / b < 4 * (int64_t)omp_get_max_threads()) b /= 2;
    return b;
}

static void one_row(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t n, int64_t k) {
    const int64_t steps = k / 32, blocks = n / 16, chunk = blocks_per_chunk(blocks, ONE_ROW_BLOCKS);
    const uint32_t *pairs = (const uint32_t *)x;
#pragma omp parallel for schedule(static)
    for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
        const int nb = (int)(blocks - b0 < chunk ? blocks - b0 : chunk);
        __m512 acc[ONE_ROW_BLOCKS];
        for (int b = 0; b < ONE_ROW_BLOCKS; b++) acc[b] = _mm512_setzero_ps();
        for (int64_t s = 0; s < steps; s++)
            for (int b = 0; b < nb; b++) {
                const uint16_t *tile = w + (b0 + b) * 16 * k + s * 512;
                prefetch_tile(tile, s, steps, PREFETCH_STEPS, nb * 16 * k);
                for (int p = 0; p < 16; p++)
                    acc[b] = _mm512_dpbf16_ps(acc[b], (__m512bh)_mm512_loadu_si512(tile + p * 32),
                                              (__m512bh)_mm512_set1_epi32((int)pairs[s * 16 + p]));
            }
        for (int b = 0; b < nb; b++)
            _mm256_storeu_si256((__m256i *)(out + (b0 + b) * 16), (__m256i)_mm512_cvtneps_pbh(acc[b]));
    }
}

static void two_rows(const uint16_t *x, const uint16_t *w, uint16_t *out, int64_t n, int64_t k) {
    const int64_t steps = k / 32, blocks = n / 16, chunk = blocks_per_chunk(blocks, TWO_ROW_BLOCKS);
    const uint32_t *pairs0 = (const uint32_t *)x, *pairs1 = pairs0 + k / 2;
#pragma omp parallel for schedule(static)
    for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
        const int nb = (int)(blocks - b0 < chunk ? blocks - b0 : chunk);
        __m512 acc[TWO_ROW_BLOCKS][2];
        for (int b = 0; b < TWO_ROW_BLOCKS; b++) acc[b][0] = acc[b][1] = _mm512_setzero_ps();
        for (int64_t s = 0; s < steps; s++)
            for (int b = 0; b < nb; b++) {
                const uint16_t *tile = w + (b0 + b) * 16 * k + s * 512;
                prefetch_tile(tile, s, steps, TWO_ROW_PREFETCH_STEPS, nb * 16 * k);
                for (int p = 0; p < 16; p++) {
                    const __m512bh line = (__m512bh)_mm512_loadu_si512(tile + p * 32);
                    acc[b][0] = _mm512_dpbf16_ps(acc[b][0], line, (__m512bh)_mm512_set1_epi32((int)pairs0[s * 16 + p]));
                    acc[b][1] = _mm512_dpbf16_ps(acc[b][1], line, (__m512bh)_mm512_set1_epi32((int)pairs1[s * 16 + p]));
                }
            }
        for (int b = 0; b < nb; b++)
            for (int i = 0; i < 2; i++)
                _mm256_storeu_si256((__m256i *)(out + i * n + (b0 + b) * 16), (__m256i)_mm512_cvtneps_pbh(acc[b][i]));
    }
}

/* Three rows and more without AMX (AVX512-BF16 alone, as on AMD's Zen 4): register tiles of RT_ROWS
 * input rows by RT_BLOCKS 16-output blocks, 24 float32 accumulators. Each input pair step loads one
 * 64-byte line of each block and multiplies it by each row's broadcast pair: 24 dot products for 4
 * line loads and 6 broadcasts, so the products, not the loads, set the pace. Every output adds its
 * input pairs in order from zero, as one_row and two_rows do, and is rounded once the same way: a row
 * gets the same bits whatever rows share its call (a decode step's, a prompt's). The block group's
 * weights (32 k bytes a block) stay in L2 while every row tile passes over them, and each tile pulls its
 * share of the next group into L2 (l2_share.h), spread evenly over its steps, so the memory streams while the
 * products run. Before, the first tile of a group waited on memory, and only the second pulled in the
 * next group: one core multiplied and streamed in turns. Over the 0.6B model's 112 decoder weights on
 * one core of AMD's Zen 4, medians of five passes in turns with the earlier kernel (the same bits):
 * 0.79x its time at 12 and 16 rows, 0.74x at 24, 0.85x at 32, 0.91x at 64, 0.94x at 128 and 0.97x at
 * 512; in the engine, a decode step of 12 or 16 sequences took 0.85x (bench/bench_kernel_revision.py).
 *
 * A decode step of 7-20 rows takes tiles of up to RT_WIDE_ROWS rows by two blocks instead (24
 * accumulators too, 2 line loads and 12 broadcasts a pair step), over groups of two blocks: 7-12 rows
 * make one pass that streams the weights once, 13-20 two. Against the tiles of six rows by four blocks,
 * over the 112 weights: 0.86-0.90x the time at 7-20 rows, 1.01x at 24 and 1.02x at 64; in the engine's
 * decode steps of 8 / 12 / 16 / 24 sequences 0.91x / 0.89x / 0.87x / 1.05x. Past RT_WIDE_MAX the rows
 * are spread evenly over the tiles (32 rows as 6 + 6 + 5 + 5 + 5 + 5, not five of 6 and one of 2): 0.91x
 * the time at 32 rows over the weights, 0.95x in the engine's decode steps of 32 sequences. */
#define RT_ROWS 6
#define RT_BLOCKS 4
#define RT_WIDE_ROWS 12 /* rows of a tile over two blocks */
#define RT_WIDE_MAX 20  /* the most rows that take tiles over two blocks */
#define RT_PREFETCH_PAIRS 16 /* weight lines ahead in each block's stream (1 KB) */

/* A tile of the MLP's gate/up weight with its activation (vnni_linear_silu): blocks 2-3 are the up blocks of
 * blocks 0-1's outputs, `up` values on, their share of the next group's up blocks `pull_up`, and the tile
 * writes F.silu(gate) * up. on: a constant at each call, so the plain tiles compile as before. */
typedef struct {
    int on;
    int64_t up;
    l2_share pull_up;
} silu_group;

#define NO_SILU ((silu_group){0, 0, {0}})

/* A result rounded to bf16 as the plain tile stores it (cvtneps), widened back: what silu_and_mul_row
 * loads from the unfused product, so the fused tile gives its bits. */
static inline __m512 as_bf16(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

/* One register tile: `rows` input rows by `nb` blocks, every pair step loading one line of each block and
 * multiplying it by each row's broadcast pair. Its share of the next group comes in L2_SHARE_STEPS steps at
 * a time (l2_share.h). */
static inline __attribute__((always_inline)) void row_tile(const uint32_t *pairs, int64_t k, const uint16_t *w,
                                                           uint16_t *out, int64_t n, const int rows, const int nb,
                                                           l2_share pull, const silu_group silu) {
    __m512 acc[RT_ROWS][RT_BLOCKS];
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++) acc[r][b] = _mm512_setzero_ps();
    const int64_t steps = k / 2; /* a multiple of L2_SHARE_STEPS: k is of 32 */
    for (int64_t p0 = 0; p0 < steps; p0 += L2_SHARE_STEPS) {
        l2_share_steps(&pull, p0, p0 + L2_SHARE_STEPS, steps);
        if (silu.on) l2_share_steps(&silu.pull_up, p0, p0 + L2_SHARE_STEPS, steps);
        for (int64_t p = p0; p < p0 + L2_SHARE_STEPS; p++) {
            __m512bh line[RT_BLOCKS];
            for (int b = 0; b < nb; b++) {
                const uint16_t *at = (silu.on && b >= 2 ? w + silu.up + (b - 2) * 16 * k : w + b * 16 * k) + p * 32;
                _mm_prefetch((const char *)(at + RT_PREFETCH_PAIRS * 32), _MM_HINT_T0);
                line[b] = (__m512bh)_mm512_loadu_si512(at);
            }
            for (int r = 0; r < rows; r++) {
                const __m512bh pair = (__m512bh)_mm512_set1_epi32((int)pairs[r * steps + p]);
                for (int b = 0; b < nb; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], line[b], pair);
            }
        }
    }
    if (silu.on) { /* out: (rows, n) activations; blocks 0-1 gate, 2-3 up of the same 32 outputs */
        for (int r = 0; r < rows; r++)
            for (int b = 0; b < 2; b++)
                store_bf16(out + r * n + b * 16, silu_and_mul16(as_bf16(acc[r][b]), as_bf16(acc[r][b + 2])));
        return;
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < nb; b++)
            _mm256_storeu_si256((__m256i *)(out + r * n + b * 16), (__m256i)_mm512_cvtneps_pbh(acc[r][b]));
}

/* A tile of 7-12 rows by two blocks (a decode step's), pulling its share of the next group a step at a time:
 * such a tile, one or two to a group, pulls a line or two every step, and asked for in row_tile's bursts
 * 8 / 12 / 16 rows took 1.07x / 1.08-1.10x / 1.00-1.02x the time over the 112 weights. Kept apart from
 * row_tile: with both ways in one function GCC moved more of the twelve row pointers through vector
 * registers and the stack every step. */
static inline __attribute__((always_inline)) void wide_tile(const uint32_t *pairs, int64_t k, const uint16_t *w,
                                                            uint16_t *out, int64_t n, const int rows,
                                                            l2_share pull) {
    __m512 acc[RT_WIDE_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t steps = k / 2;
    for (int64_t p = 0; p < steps; p++) {
        __m512bh line[2];
        for (int b = 0; b < 2; b++) {
            const uint16_t *at = w + b * 16 * k + p * 32;
            _mm_prefetch((const char *)(at + RT_PREFETCH_PAIRS * 32), _MM_HINT_T0);
            line[b] = (__m512bh)_mm512_loadu_si512(at);
        }
        l2_share_step(&pull, steps);
        for (int r = 0; r < rows; r++) {
            const __m512bh pair = (__m512bh)_mm512_set1_epi32((int)pairs[r * steps + p]);
            for (int b = 0; b < 2; b++) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], line[b], pair);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < 2; b++)
            _mm256_storeu_si256((__m256i *)(out + r * n + b * 16), (__m256i)_mm512_cvtneps_pbh(acc[r][b]));
}

/* row_tile with its row and block counts constants, so each tile's loops unroll into registers. */
#define ROW_TILE_CASE(r) \
    case r: nb == RT_BLOCKS ? row_tile(pairs, k, w, out, n, r, RT_BLOCKS, pull, NO_SILU) \
          : nb == 2 ? row_tile(pairs, k, w, out, n, r, 2, pull, NO_SILU) \
                    : row_tile(pairs, k, w, out, n, r, 1, pull, NO_SILU); break;
#define WIDE_TILE_CASE(r) \
    case r: wide_tile(pairs, k, w, out, n, r, pull); break;

static void row_tile_of(const uint32_t *pairs, int64_t k, const uint16_t *w, uint16_t *out, int64_t n, int rows,
                        int nb, l2_share pull) {
    switch (rows) {
        ROW_TILE_CASE(1) ROW_TILE_CASE(2) ROW_TILE_CASE(3) ROW_TILE_CASE(4) ROW_TILE_CASE(5) ROW_TILE_CASE(6)
        WIDE_TILE_CASE(7) WIDE_TILE_CASE(8) WIDE_TILE_CASE(9) WIDE_TILE_CASE(10) WIDE_TILE_CASE(11)
        WIDE_TILE_CASE(12)
    }
}

/* row_tile of the gate/up weight, its activation written: a group of two gate and two up blocks. */
#define SILU_TILE_CASE(r) \
    case r: row_tile(pairs, k, w, out, n, r, RT_BLOCKS, pull, (silu_group){1, up, pull_up}); break;

static void row_tile_silu_of(const uint32_t *pairs, int64_t k, const uint16_t *w, uint16_t *out, int64_t n, int rows,
                             l2_share pull, int64_t up, l2_share pull_up) {
    switch (rows) { SILU_TILE_CASE(1) SILU_TILE_CASE(2) SILU_TILE_CASE(3) SILU_TILE_CASE(4) SILU_TILE_CASE(5)
                    SILU_TILE_CASE(6) }
}

/* With silu (more than RT_WIDE_MAX rows, n gate outputs a multiple of 32), w is a gate/up weight (2n, k) and
 * out the (m, n) activations: each group is two gate blocks and the up blocks of the same outputs, so the
 * (m, 2n) product is never written and read back. */
static void avx512_rows(const uint16_t *x, const uint16_t *w, uint16_t *out, int m, int64_t n, int64_t k, int silu) {
    const int64_t blocks = n / 16;
    const uint32_t *pairs = (const uint32_t *)x;
    /* Rows that fit one tile make one pass, which only streams the weights: one block at a time, one
     * stream, as one_row (3-5 rows over the 112 weights: 43-46 ms against 48-52 ms with 4 blocks in
     * flight, alike at 6). More rows pass over each group of blocks from L2 (two blocks up to RT_WIDE_MAX
     * rows, RT_BLOCKS past it), in tiles as even as the tile's rows allow (16 rows as 8 + 8, 32 as 6 + 6 +
     * 5 + 5 + 5 + 5), each pulling in an even share of the next group. */
    const int wide = m > RT_ROWS && m <= RT_WIDE_MAX, most = wide ? RT_WIDE_ROWS : RT_ROWS;
    const int group = silu ? 2 : m <= RT_ROWS ? 1 : wide ? 2 : RT_BLOCKS;
    const int tiles = (m + most - 1) / most;
#pragma omp parallel for schedule(static)
    for (int64_t b0 = 0; b0 < blocks; b0 += group) {
        const int nb = blocks - b0 < group ? (int)(blocks - b0) : group; /* not 3: n is a multiple of 32 */
        /* Every tile of this group pulls its share of the next group into L2, so the next group's
         * first tile finds it there and the memory streams while the products run. */
        const int64_t next_blocks = group == 1 || b0 + group >= blocks ? 0
                                    : (blocks - b0 - group < group ? blocks - b0 - group : group);
        const int64_t next_lines = next_blocks * 16 * k * 2 / 64;
        for (int t = 0, m0 = 0, rows; m0 < m; t++, m0 += rows) {
            rows = (m - m0 + tiles - t - 1) / (tiles - t); /* the rows left, evenly over the tiles left */
            const uint32_t *tile_pairs = pairs + (int64_t)m0 * (k / 2);
            uint16_t *tile_out = out + (int64_t)m0 * n + b0 * 16;
            const l2_share pull = l2_share_of(w + (b0 + group) * 16 * k, next_lines, tiles, t);
            if (silu) /* the up blocks n * k values after the gate blocks */
                row_tile_silu_of(tile_pairs, k, w + b0 * 16 * k, tile_out, n, rows, pull, n * k,
                                 l2_share_of(w + (blocks + b0 + group) * 16 * k, next_lines, tiles, t));
            else
                row_tile_of(tile_pairs, k, w + b0 * 16 * k, tile_out, n, rows, nb, pull);
        }
    }
}

#ifdef VNNI_AMX
/* Tiles 0-3: results, 2g + j for input group g and weight block j; 4-5: the two input groups (rows0,
 * rows1 rows of 32 inputs); 6-7: the two weight blocks' tiles (16 input pairs by 16 outputs). */
static void configure_vnni(int rows0, int rows1) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    const int rows[2] = {rows0, rows1};
    for (int g = 0; g < 2; g++) {
        cfg.rows[2 * g] = cfg.rows[2 * g + 1] = cfg.rows[4 + g] = (uint8_t)rows[g];
        cfg.colsb[2 * g] = cfg.colsb[2 * g + 1] = cfg.colsb[4 + g] = 64;
        cfg.rows[6 + g] = 16;
        cfg.colsb[6 + g] = 64;
    }
    __asm__ volatile("" : : "r"(&cfg) : "memory"); /* as in configure(): keep the stores above */
    _tile_loadconfig(&cfg);
}

/* One group of up to 16 rows against four weight blocks at a time (quad_product): tiles 0-3 the four
 * blocks' results, 4 the input group, 5-7 weight tiles. A superset of configure_vnni(rows, 0)'s tiles
 * 0, 1, 4, 6 and 7, so block_product runs under it too (a last lone block pair). */
static void configure_quad(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)(t < 5 ? rows : 16);
        cfg.colsb[t] = 64;
    }
    __asm__ volatile("" : : "r"(&cfg) : "memory"); /* as in configure(): keep the stores above */
    _tile_loadconfig(&cfg);
}

/* A block pair's results, stored from the tiles, and where they go: rows m0..m0+rows-1 (the first 16
 * in tiles 0-1, the rest in 2-3), columns n0..n0+31 of out (n wide), or with `silu` columns n0..n0+15
 * of act from a gate tile (0, 2) and an up tile (1, 3). */
typedef struct {
    float (*c)[256];
    uint16_t *out;
    int64_t n0, n;
    int m0, rows, silu;
    int quad; /* four blocks of one group (quad_product): tiles 2-3 are the same rows' next columns */
} results;

/* Row j of two stored result tiles (c0, c1: that row's 16 values in each) into the output from column
 * n0, rounded to bf16 as torch rounds: one 64-byte line (the tiles' 16 columns side by side), or with
 * silu 16 activations, each of gate and up rounded to bf16 first as the unfused path writes them, then
 * silu.h's SiLU and product (silu_and_mul's bits). */
static inline void write_pair(const results *r, const float *c0, const float *c1, int j, int64_t n0) {
    uint16_t *at = r->out + (int64_t)(r->m0 + j) * r->n + n0;
    if (r->silu) {
        store_bf16(at, silu_and_mul16(_mm512_castsi512_ps(round_bf16x16(_mm512_load_ps(c0))),
                                      _mm512_castsi512_ps(round_bf16x16(_mm512_load_ps(c1)))));
        return;
    }
    _mm512_storeu_si512(at, (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(c1), _mm512_load_ps(c0)));
}

/* With quad, tiles 0-1 give the row's first 32 outputs (16 activations with silu) and tiles 2-3 the next. */
static inline void write_row(const results *r, int j) {
    if (r->quad) {
        write_pair(r, r->c[0] + j * 16, r->c[1] + j * 16, j, r->n0);
        write_pair(r, r->c[2] + j * 16, r->c[3] + j * 16, j, r->n0 + (r->silu ? 16 : 32));
        return;
    }
    write_pair(r, r->c[j < 16 ? 0 : 2] + (j & 15) * 16, r->c[j < 16 ? 1 : 3] + (j & 15) * 16, j, r->n0);
}

/* The weight block a thread multiplies next, pulled into L2 a share at a time while this block's
 * `pairs` group pairs multiply: two ranges of 16 rows (the next w0 and w1), and this pair's place
 * among the pass's (q of pairs). */
typedef struct {
    const char *w0, *w1;
    int q, pairs;
} next_block;

/* Step s's share of the next block's lines: 16 lines of each range for every step, over all the
 * pass's pairs, so each pair and step asks for about as many. */
static inline __attribute__((always_inline)) void prefetch_share(const next_block *b, int64_t s, int64_t steps) {
    const int64_t slot = b->q * steps + s;
    for (int64_t l = slot * 16 / b->pairs; l < (slot + 1) * 16 / b->pairs; l++) {
        _mm_prefetch(b->w0 + l * 64, _MM_HINT_T1);
        _mm_prefetch(b->w1 + l * 64, _MM_HINT_T1);
    }
}

/* The results of weight blocks w0, w1 for input rows `now->m0`.. in one or two groups of 16 (a0, a1;
 * a1 unused when rows1 is 0), over `steps` 32-input steps: a group's tile for step s is at a + s * astep,
 * its rows astride bytes apart. prefetch > 0 pulls the weight tiles that many steps ahead (the first
 * pass over a block, from memory), and past a block's end the block `next` values on; a non-NULL
 * `ahead` also pulls this step's share of the thread's next block into L2. With silu, w0 is a block of
 * gate rows and w1 the up rows of the same 16 outputs.
 *
 * The results of the block before (`before`, or NULL) are written out one row per step, between this
 * block's tile products: rounding, SiLU and the stores then run on the vector units while the tile
 * unit multiplies, where written after the products they left it idle. This block's own results are
 * only stored into now->c, for the block after (or the caller) to write. Inlined so each call site's
 * strides fold into its loop.
 *
 * The products and the next step's loads in amx_tiles.h's order (step_products): over the 0.6B model's
 * four matmuls, in turns with all four loads at the top of each step, 0.89-0.90x the time from 64 to
 * 768 rows; in the engine, prefills of 32 / 128 / 512 / 768 tokens took 0.94x / 0.93x / 0.92x / 0.91x
 * the time. Loading the second weight tile before the second input group did best of the orders tried;
 * products sharing a weight tile first did worse (1.04-1.05x).
 *
 * A prompt's passes (`ahead` given) load their tiles as TILELOADDT1: each step brings 4 KB of tiles
 * through L1, which as ordinary loads pushed out the stored results the next block writes out, and
 * the rows being written; prompts of 128-768 tokens in the engine took 0.91-0.94x the time
 * (docs/served-speed.md, item 40). Decode steps keep ordinary loads (their input rows are read again
 * for every block). */
static inline __attribute__((always_inline)) void
block_product(const uint16_t *w0, const uint16_t *w1, const uint16_t *a0, const uint16_t *a1, int64_t astride,
              int64_t astep, int64_t steps, int rows0, int rows1, int prefetch, int64_t next, const results *before,
              const results *now, const next_block *ahead) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int pending = before ? before->rows : 0;
    const tile_steps t = {(const char *)a0, (const char *)a1, (const char *)w0, (const char *)w1,
                          astride, astep * 2, 1024, rows1 != 0, 1, ahead != NULL};
    load_first_tiles(&t);
    for (int64_t s = 0; s < steps; s++) {
        if (prefetch) {
            prefetch_tile(w0 + s * 512, s, steps, prefetch, next);
            prefetch_tile(w1 + s * 512, s, steps, prefetch, next);
        }
        if (ahead) prefetch_share(ahead, s, steps);
        step_products(&t, s, steps);
        if (s < pending) write_row(before, (int)s);
    }
    for (int j = (int)steps; j < pending; j++) write_row(before, j); /* fewer steps than rows (k < 1024) */
    _tile_stored(0, now->c[0], 64);
    _tile_stored(1, now->c[1], 64);
    if (rows1) {
        _tile_stored(2, now->c[2], 64);
        _tile_stored(3, now->c[3], 64);
    }
}

/* The results of four weight blocks w[0..3] for one group of `rows` input rows read in place (a: its
 * first 32 inputs, rows astride bytes apart), over `steps` 32-input steps, under configure_quad: the
 * input tile is loaded once a step for four weight tiles, where block_product loads it for two. The
 * weight tiles are pulled DECODE_PREFETCH_STEPS ahead, and past a block's end `next` values on (the
 * blocks this thread reads next). `before`'s results are written one row a step as in block_product, and
 * this call's stored into now->c. With silu the blocks are gate, up, gate, up of 32 outputs. */
static inline __attribute__((always_inline)) void
quad_product(const uint16_t *const w[4], const uint16_t *a, int64_t astride, int64_t steps, int64_t next,
             const results *before, const results *now) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int pending = before ? before->rows : 0;
    _tile_loadd(4, a, astride);
    _tile_loadd(5, w[0], 64);
    _tile_loadd(6, w[1], 64);
    _tile_loadd(7, w[2], 64);
    for (int64_t s = 0; s < steps; s++) {
        for (int b = 0; b < 4; b++) prefetch_tile(w[b] + s * 512, s, steps, DECODE_PREFETCH_STEPS, next);
        const int more = s + 1 < steps;
        /* Each load right after the last product reading its tile (tiles are not renamed). */
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, w[3] + s * 512, 64);
        _tile_dpbf16ps(1, 4, 6);
        if (more) _tile_loadd(6, w[1] + (s + 1) * 512, 64);
        _tile_dpbf16ps(2, 4, 7);
        if (more) _tile_loadd(7, w[2] + (s + 1) * 512, 64);
        _tile_dpbf16ps(3, 4, 5);
        if (more) {
            _tile_loadd(4, a + (s + 1) * 32, astride);
            _tile_loadd(5, w[0] + (s + 1) * 512, 64);
        }
        if (s < pending) write_row(before, (int)s);
    }
    for (int j = (int)steps; j < pending; j++) write_row(before, j);
    _tile_stored(0, now->c[0], 64);
    _tile_stored(1, now->c[1], 64);
    _tile_stored(2, now->c[2], 64);
    _tile_stored(3, now->c[3], 64);
}

/* Three rows and more on AMX. Up to 32 rows (a decode batch) the tiles are sized to the rows and read
 * x in place. More rows (a prefill) are copied first into 1 KB tiles, zero rows past m: strided tile
 * loads of x from L2 took 0.82x oneDNN's time at 128 rows, contiguous ones 0.69x. Each thread takes
 * whole blocks of 32 outputs (with silu, 16 outputs of gate and their 16 of up); while a pass's group
 * pairs multiply one block they pull the next into L2, where its first pair finds it (64-192 KB at the
 * 0.6B model's widths); the thread's first block of each pass comes from memory. Each block's results
 * are written during the next block's products (block_product), the thread's last ones after its loop. */
static int amx_rows(const uint16_t *x, const uint16_t *w, uint16_t *out, int m, int64_t n, int64_t k, int silu) {
    const int64_t steps = k / 32, unit = silu ? 16 : 32; /* outputs per block pair */
    const int pairs = (m + 31) / 32, in_place = m <= 32;
    const int64_t fit = PASS_BYTES / (64 * k);
    const int pass_pairs = fit < 2 ? 2 : fit > PASS_MAX_PAIRS ? PASS_MAX_PAIRS : (int)fit;
    uint16_t *tiles = in_place ? NULL : aligned_alloc(64, (size_t)pairs * 2 * steps * 1024);
    if (!in_place && !tiles) return -2;
#pragma omp parallel
    {
        if (tiles) {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < 2 * pairs; g++) {
                const int rows = group_rows(m, g * 16);
                uint16_t *dst = tiles + g * steps * 512;
                for (int64_t s = 0; s < steps; s++)
                    for (int j = 0; j < 16; j++)
                        _mm512_store_si512(dst + s * 512 + j * 32, j < rows
                                           ? _mm512_loadu_si512(x + (g * 16 + j) * k + s * 32)
                                           : _mm512_setzero_si512());
            }
        }
        const int rows0 = in_place ? group_rows(m, 0) : 16, rows1 = in_place ? group_rows(m, 16) : 16;
        const int quad = in_place && rows1 == 0; /* 3-16 rows: four weight blocks an input tile */
        if (quad) configure_quad(rows0);
        else configure_vnni(rows0, rows1 ? rows1 : 1);
        float c[2][4][256] __attribute__((aligned(64)));
        results done[2];
        int blocks = 0; /* this thread's, so far: done[blocks % 2] is the next block's */
        for (int first = 0; first < pairs; first += pass_pairs) {
            const int last = first + pass_pairs < pairs ? first + pass_pairs : pairs;
#pragma omp for schedule(static) nowait
            for (int64_t n0 = 0; n0 < n; n0 += quad ? 2 * unit : unit) {
                const uint16_t *w0 = w + n0 * k, *w1 = silu ? w + (n + n0) * k : w0 + 16 * k;
                if (quad && n0 + 2 * unit <= n) {
                    const uint16_t *const quad_w[4] = {w0, w1, w0 + 16 * k * (silu ? 1 : 2),
                                                       w1 + 16 * k * (silu ? 1 : 2)};
                    results *now = &done[blocks % 2];
                    const results *before = blocks ? &done[(blocks + 1) % 2] : NULL;
                    *now = (results){c[blocks % 2], out, n0, n, 0, rows0, silu, 1};
                    quad_product(quad_w, x, k * 2, steps, 2 * unit * k, before, now);
                    blocks++;
                    continue;
                }
                for (int p = first; p < last; p++, blocks++) {
                    const int m0 = p * 32, r0 = group_rows(m, m0), r1 = group_rows(m, m0 + 16);
                    results *now = &done[blocks % 2];
                    const results *before = blocks ? &done[(blocks + 1) % 2] : NULL;
                    *now = (results){c[blocks % 2], out, n0, n, m0, r0 + r1, silu, 0};
                    if (in_place)
                        block_product(w0, w1, x, x + 16 * k, k * 2, 32, steps, r0, r1, DECODE_PREFETCH_STEPS, unit * k,
                                      before, now, NULL);
                    else {
                        const uint16_t *a0 = tiles + 2 * p * steps * 512, *a1 = a0 + steps * 512;
                        const next_block ahead = {(const char *)(w0 + unit * k), (const char *)(w1 + unit * k),
                                                  p - first, last - first};
                        if (p == first)
                            block_product(w0, w1, a0, a1, 64, 512, steps, r0, r1, PREFETCH_STEPS, unit * k, before,
                                          now, &ahead);
                        else
                            block_product(w0, w1, a0, a1, 64, 512, steps, r0, r1, 0, 0, before, now, &ahead);
                    }
                }
            }
        }
        if (blocks)
            for (int j = 0; j < done[(blocks + 1) % 2].rows; j++) write_row(&done[(blocks + 1) % 2], j);
        _tile_release();
    }
    free(tiles);
    return 0;
}

#endif /* VNNI_AMX */

/* x: (m, k) bf16; w: the weight in VNNI order (vnni_pack); out: (m, n) bf16. n and k multiples of 32.
 * Returns 0; -1 for a shape it does not take; -2 out of memory. */
int vnni_linear(const uint16_t *x, const uint16_t *w, uint16_t *out, int m, int64_t n, int64_t k) {
    if (m < 1 || n % 32 || k % 32) return -1;
    if (m == 1) one_row(x, w, out, n, k);
    else if (m == 2) two_rows(x, w, out, n, k);
#ifdef VNNI_AMX
    else return amx_rows(x, w, out, m, n, k, 0);
#else
    else avx512_rows(x, w, out, m, n, k, 0);
#endif
    return 0;
}

/* vnni_linear without AMX at every row count: three rows and more on the AVX-512 register tiles that
 * CPUs without AMX take (so CPUs with AMX can test them too). */
int vnni_linear_avx512(const uint16_t *x, const uint16_t *w, uint16_t *out, int m, int64_t n, int64_t k) {
    if (m < 1 || n % 32 || k % 32) return -1;
    if (m == 1) one_row(x, w, out, n, k);
    else if (m == 2) two_rows(x, w, out, n, k);
    else avx512_rows(x, w, out, m, n, k, 0);
    return 0;
}

/* act = F.silu(x Wg^T) * (x Wu^T), rounded as torch rounds it on the bf16 matmul outputs: w is a gate/up
 * weight (2n, k) in VNNI order, its n gate rows first; act: (m, n) bf16. n a multiple of 16, k of 32.
 * From three rows each AMX block pair is a gate block and the up block of the same outputs, and the
 * activation is applied to the result tiles: the (m, 2n) product is never written or read back. Without
 * AMX the register tiles do so past RT_WIDE_MAX rows where n is a multiple of 32; fewer rows (a decode
 * step's, whose product stays in cache) write it to a buffer first. Returns 0; -1 for a shape it does
 * not take; -2 out of memory. */
int vnni_linear_silu(const uint16_t *x, const uint16_t *w, uint16_t *act, int m, int64_t n, int64_t k) {
    if (m < 1 || n % 16 || k % 32) return -1;
#ifdef VNNI_AMX
    if (m >= 3) return amx_rows(x, w, act, m, n, k, 1);
#endif
    if (m > RT_WIDE_MAX && n % 32 == 0) {
        avx512_rows(x, w, act, m, n, k, 1);
        return 0;
    }
    uint16_t *gate_up = malloc((size_t)m * 2 * n * sizeof(uint16_t));
    if (!gate_up) return -2;
    if (m == 1) one_row(x, w, gate_up, 2 * n, k);
    else if (m == 2) two_rows(x, w, gate_up, 2 * n, k);
    else avx512_rows(x, w, gate_up, m, 2 * n, k, 0);
    for (int r = 0; r < m; r++) silu_and_mul_row(gate_up + (int64_t)r * 2 * n, act + (int64_t)r * n, n);
    free(gate_up);
    return 0;
}

#else

int vnni_linear_supported(void) { return 0; }

int vnni_linear(const uint16_t *x, const uint16_t *w, uint16_t *out, int m, int64_t n, int64_t k) {
    (void)x, (void)w, (void)out, (void)m, (void)n, (void)k;
    return -1;
}

int vnni_linear_silu(const uint16_t *x, const uint16_t *w, uint16_t *act, int m, int64_t n, int64_t k) {
    (void)x, (void)w, (void)act, (void)m, (void)n, (void)k;
    return -1;
}

int vnni_linear_avx512(const uint16_t *x, const uint16_t *w, uint16_t *out, int m, int64_t n, int64_t k) {
    (void)x, (void)w, (void)out, (void)m, (void)n, (void)k;
    return -1;
}

#endif

/* Rows ids[0..count) of a weight (n, k) in VNNI order, copied out as plain rows into out (count, k): the
 * embedding lookup of a table that a tied head reordered. Row i is lane i % 16 of block i / 16, so its
 * input pairs lie one 64-byte line apart through that block's 32 k bytes, one forward stream a row. For
 * 512 ids of 1,024 values on one Zen 4 core this loop took 1.3 ms, torch's advanced indexing of the same
 * rows 7.7 ms (and F.embedding on a plain table 0.14 ms). Any CPU; k even. Returns 0, or -1 (nothing
 * written) for an id outside [0, n). */
int vnni_rows(const uint16_t *w, int64_t n, int64_t k, const int64_t *ids, int64_t count, uint16_t *out) {
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n) return -1;
    for (int64_t i = 0; i < count; i++) {
        const uint32_t *pairs = (const uint32_t *)(w + ids[i] / 16 * 16 * k) + ids[i] % 16;
        uint32_t *row = (uint32_t *)(out + i * k);
        for (int64_t p = 0; p < k / 2; p++) memcpy(row + p, pairs + p * 16, sizeof(uint32_t));
    }
    return 0;
}

/* w (n, k) bf16, reordered in place into VNNI order, one block of 16 rows at a time through a 16 x k
 * buffer: no second copy of the weight. n a multiple of 16, k of 2. Returns 0, or -2 out of memory. */
int vnni_pack(uint16_t *w, int64_t n, int64_t k) {
    uint16_t *block = malloc((size_t)16 * k * sizeof(uint16_t));
    if (!block) return -2;
    for (int64_t b = 0; b < n / 16; b++) {
        uint16_t *dst = w + b * 16 * k;
        memcpy(block, dst, (size_t)16 * k * sizeof(uint16_t));
        for (int64_t p = 0; p < k / 2; p++)
            for (int r = 0; r < 16; r++) {
                dst[(p * 16 + r) * 2] = block[r * k + 2 * p];
                dst[(p * 16 + r) * 2 + 1] = block[r * k + 2 * p + 1];
            }
    }
    free(block);
    return 0;
}
