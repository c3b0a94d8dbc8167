/* Timing stand-ins for the kernels decoder.c's run_layers calls through its Kernels table: each calls the
 * real kernel (set by timers_set) and adds its wall time to a counter, so a fused prefill can be split by
 * component at a cost of two clock reads a call. Matmuls are counted per (n, k) shape, which tells the
 * qkv, o, gate/up and down projections apart. For bench_prefill_layers.py only. */
#include <stdint.h>
#include <time.h>

typedef int (*linear_fn)(const uint16_t *, const uint16_t *, uint16_t *, int, int64_t, int64_t);
typedef void (*norm_fn)(const void *, int64_t, int, const void *, int, void *, int64_t, int, float, int);
typedef void (*norm_rope_fn)(const void *, int64_t, int, const void *, int, const void *, const void *, void *,
                             int64_t, int, float, int);
/* paged_attention.c's write_kv_quant (its last three arguments, the cache's kind and scales, are passed on
 * as they came: a caller of the older write_kv, without them, gets the same call). */
typedef int (*write_kv_fn)(const void *, const void *, int64_t, int64_t, void *, void *, const int64_t *, int64_t,
                           int, int64_t, int, int, int, float *, float *);
typedef int (*prefill_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, const uint16_t *, int64_t,
                          const int64_t *, int64_t, uint16_t *, int64_t, int, int, int, int, int, float);

/* Counters: 0 norm, 1 norm_rope, 2 write_kv, 3 prefill attention; then SHAPES matmul shapes. */
enum { NORM, NORM_ROPE, WRITE_KV, PREFILL, FIXED };
#define SHAPES 16
static double ns[FIXED + SHAPES];
static int64_t shape_n[SHAPES], shape_k[SHAPES], shape_silu[SHAPES];
static int shapes;
static linear_fn real_linear, real_linear_silu;
static norm_fn real_norm;
static norm_rope_fn real_norm_rope;
static write_kv_fn real_write_kv;
static prefill_fn real_prefill;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static double *shape_counter(int64_t n, int64_t k, int silu) {
    for (int i = 0; i < shapes; i++)
        if (shape_n[i] == n && shape_k[i] == k && shape_silu[i] == silu) return &ns[FIXED + i];
    if (shapes == SHAPES) return &ns[FIXED + SHAPES - 1];
    shape_n[shapes] = n, shape_k[shapes] = k, shape_silu[shapes] = silu;
    return &ns[FIXED + shapes++];
}

int timed_linear(const uint16_t *x, const uint16_t *w, uint16_t *out, int m, int64_t n, int64_t k) {
    double t = now();
    int status = real_linear(x, w, out, m, n, k);
    *shape_counter(n, k, 0) += now() - t;
    return status;
}

int timed_linear_silu(const uint16_t *x, const uint16_t *w, uint16_t *act, int m, int64_t n, int64_t k) {
    double t = now();
    int status = real_linear_silu(x, w, act, m, n, k);
    *shape_counter(n, k, 1) += now() - t;
    return status;
}

void timed_norm(const void *x, int64_t gs, int gr, const void *w, int wr, void *out, int64_t rows, int dim,
                float eps, int bf16) {
    double t = now();
    real_norm(x, gs, gr, w, wr, out, rows, dim, eps, bf16);
    ns[NORM] += now() - t;
}

void timed_norm_rope(const void *x, int64_t gs, int gr, const void *w, int wr, const void *cos, const void *sin,
                     void *out, int64_t rows, int dim, float eps, int bf16) {
    double t = now();
    real_norm_rope(x, gs, gr, w, wr, cos, sin, out, rows, dim, eps, bf16);
    ns[NORM_ROPE] += now() - t;
}

int timed_write_kv(const void *k, const void *v, int64_t ks, int64_t vs, void *kc, void *vc, const int64_t *slots,
                   int64_t tokens, int heads, int64_t num_slots, int dim, int elem, int kind, float *k_scale,
                   float *v_scale) {
    double t = now();
    int status =
        real_write_kv(k, v, ks, vs, kc, vc, slots, tokens, heads, num_slots, dim, elem, kind, k_scale, v_scale);
    ns[WRITE_KV] += now() - t;
    return status;
}

int timed_prefill(const uint16_t *q, int64_t qs, const uint16_t *k, int64_t ks, const uint16_t *v, int64_t vs,
                  const int64_t *slots, int64_t num_slots, uint16_t *out, int64_t os, int lq, int lk, int hq, int hkv,
                  int dim, float scale) {
    double t = now();
    int status = real_prefill(q, qs, k, ks, v, vs, slots, num_slots, out, os, lq, lk, hq, hkv, dim, scale);
    ns[PREFILL] += now() - t;
    return status;
}

/* The real kernels, in the order of the Kernels fields they stand in for. */
void timers_set(void *linear, void *linear_silu, void *norm, void *norm_rope, void *write_kv, void *prefill) {
    real_linear = (linear_fn)linear, real_linear_silu = (linear_fn)linear_silu, real_norm = (norm_fn)norm;
    real_norm_rope = (norm_rope_fn)norm_rope, real_write_kv = (write_kv_fn)write_kv, real_prefill = (prefill_fn)prefill;
}

/* Copies the counters (FIXED + SHAPES nanoseconds) and the shapes seen ((n, k, silu) each), returns how many
 * shapes, and zeroes the counters. */
int timers_take(double *out, int64_t *out_shapes) {
    for (int i = 0; i < FIXED + SHAPES; i++) out[i] = ns[i], ns[i] = 0;
    for (int i = 0; i < shapes; i++)
        out_shapes[3 * i] = shape_n[i], out_shapes[3 * i + 1] = shape_k[i], out_shapes[3 * i + 2] = shape_silu[i];
    int seen = shapes;
    shapes = 0;
    return seen;
}
