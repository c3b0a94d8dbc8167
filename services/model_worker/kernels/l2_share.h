/* Pulling the next weights into L2 while a group's register tiles multiply: the tile kernels without AMX
 * (vnni_linear.c's avx512_rows, w8a8_linear.c's vnni_group) pass over a group of weights once per tile of
 * rows, and each tile pulls an even share of the next group's lines in, spread over its steps, so memory
 * streams while the products run. */
#ifndef VLLM_V0_L2_SHARE_H
#define VLLM_V0_L2_SHARE_H

#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

/* A tile's share: `lines` 64-byte lines from `at`; `due` spreads them over the tile's steps. */
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
#endif

#endif
