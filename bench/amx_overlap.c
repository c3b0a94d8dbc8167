/* The loop bench_amx_overlap.py times: AMX tile products in the VNNI kernel's 2 x 2 order, their
 * operand tiles cycling through buffers sized to sit in L1 or L2, beside a stream of prefetches
 * pulling fresh lines from memory into L2, as a prefill kernel's first pass over a weight does. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) tile_config;

#define STREAM_BYTES ((size_t)1 << 30) /* far past any cache: every line comes from memory */

static char *stream;
static size_t stream_at;

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* Nanoseconds per step of `steps`: with `products`, two 1 KB tiles of each operand loaded and four
 * 16 x 16 x 32 products, the operands cycling through a_bytes and b_bytes; and `lines` prefetches
 * (into L2) of the next lines of a 1 GB buffer. Returns -1 where AMX or the memory is missing. */
double amx_overlap_step_ns(int64_t a_bytes, int64_t b_bytes, int lines, int products, int64_t steps) {
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return -1; /* ask Linux for the tile state */
    if (!stream) {
        stream = aligned_alloc(4096, STREAM_BYTES);
        if (!stream) return -1;
        memset(stream, 1, STREAM_BYTES);
    }
    char *a = aligned_alloc(4096, (size_t)a_bytes), *b = aligned_alloc(4096, (size_t)b_bytes);
    if (!a || !b) {
        free(a);
        free(b);
        return -1;
    }
    memset(a, 0, (size_t)a_bytes);
    memset(b, 0, (size_t)b_bytes);
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    __asm__ volatile("" : : "r"(&cfg) : "memory"); /* keep the stores: ldtilecfg reads them */
    _tile_loadconfig(&cfg);
    const int64_t na = a_bytes / 2048, nb = b_bytes / 2048;
    int64_t ia = 0, ib = 0;
    const double start = seconds();
    for (int64_t s = 0; s < steps; s++) {
        for (int l = 0; l < lines; l++) {
            _mm_prefetch(stream + stream_at, _MM_HINT_T1);
            stream_at = stream_at + 64 < STREAM_BYTES ? stream_at + 64 : 0;
        }
        if (products) {
            _tile_loadd(4, a + ia * 2048, 64);
            _tile_loadd(6, b + ib * 2048, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, a + ia * 2048 + 1024, 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_loadd(7, b + ib * 2048 + 1024, 64);
            _tile_dpbf16ps(3, 5, 7);
            ia = ia + 1 < na ? ia + 1 : 0;
            ib = ib + 1 < nb ? ib + 1 : 0;
        }
    }
    _tile_stored(0, a, 64); /* the products' result is used */
    const double ns = (seconds() - start) / (double)steps * 1e9;
    _tile_release();
    free(a);
    free(b);
    return ns;
}

/* Nanoseconds per round of eight independent AVX512-BF16 dot products (vdpbf16ps) on registers: the
 * vector units' speed, to set beside the tile unit's over time. */
double avx512_step_ns(int64_t rounds) {
    __m512 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);
    const double start = seconds();
    for (int64_t r = 0; r < rounds; r++)
        for (int i = 0; i < 8; i++) acc[i] = _mm512_dpbf16_ps(acc[i], x, x);
    const double ns = (seconds() - start) / (double)rounds * 1e9;
    __m512 sum = acc[0];
    for (int i = 1; i < 8; i++) sum = _mm512_add_ps(sum, acc[i]);
    return _mm512_reduce_add_ps(sum) < 0 ? -1 : ns; /* the sums are used; they are never negative */
}

#else

double amx_overlap_step_ns(int64_t a_bytes, int64_t b_bytes, int lines, int products, int64_t steps) {
    (void)a_bytes, (void)b_bytes, (void)lines, (void)products, (void)steps;
    return -1;
}

double avx512_step_ns(int64_t rounds) {
    (void)rounds;
    return -1;
}

#endif
