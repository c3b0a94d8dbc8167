/* Pulling the next weights into L2 while a group's register tiles multiply: the tile kernels without AMX
 * (vnni_linear.c's avx512_rows, w8a8_linear.c's vnni_group) pass over a group of weights once per tile of
 * rows, and each tile pulls an even share of the next group's lines in, so memory streams while the
 * products run.
 *
 * vnni_linear.c's tiles of up to six rows ask for their lines L2_SHARE_STEPS steps at a time
 * (l2_share_steps), between inner loops, not step by step inside them (l2_share_step): there the
 * per-step counter and its branch cost the inner loop its registers, and GCC moved row pointers
 * through vector registers and the stack every step. Over the 0.6B model's 112 decoder weights on one
 * core of AMD's Zen 4 (medians of four passes in turns, the same bits): 1.03x the rate at 32 rows,
 * 1.04-1.06x at 128-1,442; in the engine (bench/bench_kernel_revision.py), prompts of 128 / 512 /
 * 1,024 tokens in 0.965x / 0.949x / 0.956x the time. Its tiles of 7-12 rows and w8a8_linear.c's
 * (whose products are asm, and kept their registers) pull step by step: in segments they took
 * 1.02-1.10x the time. */
#ifndef VLLM_V0_L2_SHARE_H
#define VLLM_V0_L2_SHARE_H

#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#define L2_SHARE_STEPS 16

/* A tile's share: `lines` 64-byte lines from `at`; `due` spreads them over the tile's steps one step at a
 * time (l2_share_step). */
typedef struct {
    const char *at;
    int64_t lines, due;
} l2_share;

/* Tile t of `tiles`: its share of the `lines` lines from `next` (none where lines is 0). */
static inline l2_share l2_share_of(const void *next, int64_t lines, int64_t tiles, int64_t t) {
    const int64_t share = (lines + tiles - 1) / tiles, from = t * share < lines ? t * share : lines;
    return (l2_share){(const char *)next + from * 64, lines - from < share ? lines - from : share, 0};
}

/* One of the tile's `steps` steps: pull the lines that fall to it (a line each time due passes steps). */
static inline __attribute__((always_inline)) void l2_share_step(l2_share *s, int64_t steps) {
    for (s->due += s->lines; s->due >= steps; s->due -= steps, s->at += 64) _mm_prefetch(s->at, _MM_HINT_T1);
}

/* The lines that fall to steps [from, to) of the tile's `steps`: its share spread evenly over them. */
static inline __attribute__((always_inline)) void l2_share_steps(const l2_share *s, int64_t from, int64_t to,
                                                                 int64_t steps) {
    for (int64_t l = from * s->lines / steps; l < to * s->lines / steps; l++) _mm_prefetch(s->at + l * 64, _MM_HINT_T1);
}
#endif

#endif
