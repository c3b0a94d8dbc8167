/* Every decoder layer of a bf16 step in one call: the step's torch glue moved into C.
 *
 * A decode step of one sequence reads the 0.6B model's weights in about 45 ms, and the C kernels
 * already do the arithmetic; around them each layer spent about 0.2 ms in Python: a dozen module
 * calls, views, splits, adds, SiLU and a multiply, and ctypes calls with their argument checks.
 * Here the layer loop runs in C and calls the same kernels (small_batch_linear.c, amx_linear.c,
 * rms_norm.c, paged_attention.c) through function pointers the caller hands in, so each op is the
 * code the unfused path runs, on the same inputs. The ops torch did are written to round as torch
 * does: a bf16 add or multiply is a float32 one rounded to nearest even, and SiLU is torch's
 * x / (1 + exp(-x)) with exp computed as Sleef's expf (u10), the routine torch's vectorised exp
 * calls; for every one of the 65,536 bf16 inputs it equals torch's F.silu bit for bit (tested).
 * The fused step's hidden states equal the unfused step's bit for bit (tested).
 *
 * A step with prompts in it (on kernels that take any row count: bf16 weights in VNNI order, or int8
 * weights times int8 activations) runs here too: each prompt's attention is prefill_attention.c's call
 * on its own rows, as the layer-by-layer path makes it, and the step's one-row sequences take the
 * decode kernel together. A fresh 128-token prompt of the 0.6B model then prefills in 0.94x the
 * layer-by-layer path's time on one core (its Python, torch's adds and copies between the kernels).
 *
 * A step with LoRA adapter rows runs here too: right after each target matmul, before anything reads
 * its output, lora.c's SGMV (the unfused path's add_lora, called through a pointer like the other
 * kernels) adds each adapter row's product into it, with the same float32 sums and one rounding.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kv8.h"
#include "silu.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef int (*linear_fn)(const uint16_t *x, const uint16_t *w, uint16_t *out, int m, int64_t n, int64_t k);
/* q8_linear.c's: 8-bit weights (int8, or fp8 e4m3 with fp8 1) and their float32 scales per block of bk inputs. */
typedef int (*q8_linear_fn)(const uint16_t *x, const uint8_t *w, const float *scales, uint16_t *out, int m, int64_t n,
                            int64_t k, int64_t bk, int fp8);
typedef void (*norm_fn)(const void *x, int64_t group_stride, int group_rows, const void *weight, int weight_rows,
                        void *out, int64_t rows, int dim, float eps, int is_bf16);
typedef void (*norm_rope_fn)(const void *x, int64_t group_stride, int group_rows, const void *weight,
                             int weight_rows, const void *cos, const void *signed_sin, void *out, int64_t rows,
                             int dim, float eps, int is_bf16);
/* paged_attention.c's write_kv_quant and paged_decode_attention_kv: caches in bf16 (kv_kind 0, scales NULL) or
 * 8-bit (kv_kind 1 fp8, 2 int8, with their scales), quantized as written and widened as read. */
typedef int (*write_kv_fn)(const void *k, const void *v, int64_t k_stride, int64_t v_stride, void *k_cache,
                           void *v_cache, const int64_t *slots, int64_t tokens, int num_kv_heads, int64_t num_slots,
                           int head_dim, int elem_size, int kv_kind, float *k_scale, float *v_scale);
typedef int (*attention_fn)(const void *q, const void *k_cache, const void *v_cache, void *out,
                            const int32_t *context_lens, const int32_t *block_tables, int64_t num_slots,
                            int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                            int max_blocks, int is_bf16, float scale, int kv_kind, const float *k_scale,
                            const float *v_scale);
typedef int (*prefill_attention_fn)(const uint16_t *q, int64_t q_stride, const uint16_t *k, int64_t k_stride,
                                    const uint16_t *v, int64_t v_stride, const int64_t *slots, int64_t num_slots,
                                    uint16_t *out, int64_t out_stride, int lq, int lk, int heads, int kv_heads,
                                    int head_dim, float scale);
/* vnni_linear.c's: F.silu(gate) * up of a gate/up weight's product, its activation on the result tiles. */
typedef int (*linear_silu_fn)(const uint16_t *x, const uint16_t *w, uint16_t *act, int m, int64_t n, int64_t k);

/* lora.c's lora_sgmv: y (rows, out) += x A^T B^T for each adapter row, grouped by slot; 0, or -1 out of memory. */
typedef int (*sgmv_fn)(void *y, const void *x, const void *a, const void *b, int bf16, const int64_t *rows,
                       const int64_t *starts, const int64_t *slots, const int64_t *ranks, int64_t num_segments,
                       int64_t in, int64_t out, int64_t width, int64_t num_parts, const int64_t *part_ends);

/* The kernels, and the row counts SmallBatchLinear routes to each: AMX from amx_min_rows to
 * amx_max_rows where a weight allows it, the AVX512-BF16 kernel up to small_max_rows. 8-bit weights
 * (a layer with scales) as EightBitLinearMethod routes them: q8 up to q8_small_max_rows, q8_amx from
 * there to amx_max_rows where a weight allows it, else q8 up to q8_no_amx_max_rows. max_rows: the
 * most rows a step may have. sgmv: LoRA's, where the model has adapter slots. */
typedef struct {
    linear_fn small, amx;
    norm_fn norm;
    norm_rope_fn norm_rope;
    write_kv_fn write_kv;
    attention_fn attention;
    int small_max_rows, amx_min_rows, amx_max_rows;
    q8_linear_fn q8, q8_amx;
    int q8_small_max_rows, q8_no_amx_max_rows, max_rows;
    prefill_attention_fn prefill;
    linear_silu_fn linear_silu;
    sgmv_fn sgmv;
} Kernels;

typedef struct {
    int hidden, heads, kv_heads, head_dim, intermediate, block_size;
    int64_t num_slots;
    float eps, scale;
} Shape;

/* One linear layer's adapter slots (model/lora/slots.py LoraSlots): a (slots, num_parts x width, in), b (slots,
 * width, out), part_ends (num_parts,); a NULL where the layer has none. */
typedef struct {
    const uint16_t *a, *b;
    const int64_t *part_ends;
    int64_t num_parts, width;
} LoraLinear;

/* A step's adapter rows grouped by slot (model/lora/batch.py LoraBatch): segment i is rows[starts[i]] ..
 * rows[starts[i + 1] - 1], in slot slots[i] at rank ranks[i]. */
typedef struct {
    const int64_t *rows, *starts, *slots, *ranks;
    int64_t segments;
} LoraRows;

/* One layer's weights (bf16, contiguous, as the checkpoint's tensors) and cache; *_amx: whether
 * that weight may take the AMX kernel (its output size a multiple of 32). With 8-bit weights the four
 * matmul weights are bytes, *_scale their scales (NULL for bf16) and fp8 says which format. kv_kind:
 * the cache's (0 bf16; 1 fp8, 2 int8, with k_scale and v_scale; a prompt's keys are dequantized for the prefill
 * kernel, as the layer-by-layer path gathers them).
 * lora: the adapter slots of qkv, o, gate_up and down, in that order. */
typedef struct {
    const uint16_t *input_norm, *qkv, *qk_norm, *o, *post_norm, *gate_up, *down;
    uint16_t *k_cache, *v_cache;
    int qkv_amx, o_amx, gate_up_amx, down_amx;
    const float *qkv_scale, *o_scale, *gate_up_scale, *down_scale;
    int fp8;
    int kv_kind;
    float *k_scale, *v_scale;
    LoraLinear lora[4];
} Layer;

/* The sequences of a step with prompts in it. A prompt (more than one new row) is rows starts[i] ..
 * starts[i] + lens[i] - 1 and attends over keys[i] keys: its own rows where key_slots[i] is NULL (a
 * fresh prompt), else the cache slots key_slots[i] (keys[i],) holds (cached tokens before it). The
 * one-row sequences sit at rows decode_rows (decodes,), with their context_lens and block_tables
 * (decodes, max_blocks). */
typedef struct {
    int count;
    const int32_t *starts, *lens, *keys;
    const int64_t *const *key_slots;
    int decodes, max_blocks;
    const int64_t *decode_rows;
    const int32_t *context_lens, *block_tables;
} Prompts;

/* One step of `rows` rows. cos, signed_sin: (rows, head_dim) rotary tables; slots: (rows,) cache slots.
 * prompts NULL: every row is a sequence with one new token, context_lens (rows,) and block_tables
 * (rows, max_blocks) theirs; else the step's layout is in prompts. lora: the adapter rows, NULL where none.
 * keep: NULL, or the rows (ascending, keep_count of them) whose final hidden states are wanted: the last
 * layer runs its output projection and MLP on those alone, and the other rows come out undefined. */
typedef struct {
    int rows, max_blocks;
    const uint16_t *cos, *signed_sin;
    const int64_t *slots;
    const int32_t *context_lens, *block_tables;
    const Prompts *prompts;
    const LoraRows *lora;
    const int64_t *keep;
    int keep_count;
} Step;

static int linear(const Kernels *kn, int amx_ok, const uint16_t *x, const uint16_t *w, const float *scale, int fp8,
                  uint16_t *out, int m, int64_t n, int64_t k) {
    if (scale) {
        const uint8_t *q = (const uint8_t *)w;
        const int64_t bk = fp8 ? 128 : k; /* fp8: Qwen's 128-wide blocks; int8: one scale a row */
        const int amx = amx_ok && kn->q8_amx;
        if (m <= kn->q8_small_max_rows || (!amx && m <= kn->q8_no_amx_max_rows))
            return kn->q8(x, q, scale, out, m, n, k, bk, fp8);
        if (amx && m <= kn->amx_max_rows) return kn->q8_amx(x, q, scale, out, m, n, k, bk, fp8);
        return -100;
    }
    if (amx_ok && kn->amx && m >= kn->amx_min_rows && m <= kn->amx_max_rows) return kn->amx(x, w, out, m, n, k);
    if (m <= kn->small_max_rows) return kn->small(x, w, out, m, n, k);
    return -100; /* the caller checked the rows: unreachable */
}

/* y (rows, out) += each adapter row's product of x (rows, in), as add_lora does after the layer's matmul:
 * nothing where the step has no adapter rows or the layer no slots. Returns 0, or -2 out of memory. */
static int add_lora(const Kernels *kn, const LoraLinear *slots, const LoraRows *lora, uint16_t *y, const uint16_t *x,
                    int64_t in, int64_t out) {
    if (!lora || !slots->a) return 0;
    return kn->sgmv(y, x, slots->a, slots->b, 1, lora->rows, lora->starts, lora->slots, lora->ranks, lora->segments,
                    in, out, slots->width, slots->num_parts, slots->part_ends) ? -2 : 0;
}

/* act = bf16(bf16(silu(gate)) * up) for each row of gate_up = [gate | up]: F.silu(gate) * up.
 * Returns 0, or -1 (nothing written) without AVX-512 or where n is not a multiple of 16. */
int silu_and_mul(const uint16_t *gate_up, uint16_t *act, int rows, int64_t n) {
#if defined(__AVX512F__)
    if (n % 16) return -1;
#pragma omp parallel for schedule(static) if ((int64_t)rows * n >= 16384) /* 6 rows of 3072 and up */
    for (int r = 0; r < rows; r++) silu_and_mul_row(gate_up + (int64_t)r * 2 * n, act + (int64_t)r * n, n);
    return 0;
#else
    (void)gate_up, (void)act, (void)rows, (void)n;
    return -1;
#endif
}

/* hidden = bf16(hidden + delta), as torch adds two bf16 tensors. */
static void add_rows(uint16_t *hidden, const uint16_t *delta, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        store_bf16(hidden + i, round_bf16x16(_mm512_add_ps(load_bf16(hidden + i), load_bf16(delta + i))));
#endif
    for (; i < n; i++) hidden[i] = f32_to_bf16(bf16_to_f32(hidden[i]) + bf16_to_f32(delta[i]));
}

int decoder_supported(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}

/* n rows of an 8-bit cache at slots, every KV head, as kv_quant.dequantize gives them back: bf16(float32(q) *
 * scale), the scale fp8's one per layer or int8's of the row. Row j of head g goes to out + (j * Hkv + g) * D,
 * where the prefill kernel reads a prompt's own rows. */
static void dequantize_rows(const uint8_t *cache, const float *scales, int kind, const int64_t *slots, int n,
                            int Hkv, int64_t num_slots, int D, uint16_t *out) {
    const int fp8 = kind == KV_FP8;
    for (int j = 0; j < n; j++)
        for (int g = 0; g < Hkv; g++) {
            const int64_t at = (int64_t)g * num_slots + slots[j];
            const uint8_t *q = cache + at * D;
            const float s = fp8 ? scales[0] : scales[at];
            uint16_t *dst = out + ((int64_t)j * Hkv + g) * D;
            int d = 0;
#if defined(__AVX512F__)
            /* widen8x16 gives fp8 as 2^-8 of its value: times 256 is exact, so one rounding, at the scale. */
            const __m512 scale = _mm512_set1_ps(s), unit = _mm512_set1_ps(fp8 ? 256.0f : 1.0f);
            for (; d + 16 <= D; d += 16)
                store_bf16(dst + d, round_bf16x16(_mm512_mul_ps(_mm512_mul_ps(widen8x16(q + d, fp8), unit), scale)));
#endif
            for (; d < D; d++) dst[d] = f32_to_bf16((fp8 ? e4m3_to_f32(q[d]) : (float)(int8_t)q[d]) * s);
        }
}

/* One prompt's attention over an 8-bit cache: its keys and values (its own rows, written to the cache a moment
 * ago, or the cached tokens before it) dequantized to bf16 as the layer-by-layer path gathers them, then the
 * prefill kernel over them as a prompt's own rows. Returns 0, -2 out of memory, -3 for a slot outside the caches
 * (nothing read, as the prefill kernel refuses one it reads through), or the kernel's status. */
static int attend_8bit(const Kernels *kn, const Shape *sh, const Layer *L, const int64_t *slots, const uint16_t *q,
                       int64_t q_stride, uint16_t *out, int64_t out_stride, int lq, int lk) {
    const int D = sh->head_dim, Hkv = sh->kv_heads;
    const int64_t width = (int64_t)Hkv * D;
    for (int j = 0; j < lk; j++)
        if (slots[j] < 0 || slots[j] >= sh->num_slots) return -3;
    uint16_t *keys = malloc(sizeof(uint16_t) * 2 * (size_t)lk * width);
    if (!keys) return -2;
    uint16_t *values = keys + (size_t)lk * width;
    dequantize_rows((const uint8_t *)L->k_cache, L->k_scale, L->kv_kind, slots, lk, Hkv, sh->num_slots, D, keys);
    dequantize_rows((const uint8_t *)L->v_cache, L->v_scale, L->kv_kind, slots, lk, Hkv, sh->num_slots, D, values);
    const int status = kn->prefill(q, q_stride, keys, width, values, width, NULL, 0, out, out_stride, lq, lk,
                                   sh->heads, Hkv, D, sh->scale);
    free(keys);
    return status;
}

/* One layer's attention of the step into attn (rows, Hq * D): q and k normalised and rotated in qk
 * (rows, (Hq + Hkv) * D), v in qkv after them; q: scratch of 2 * rows * Hq * D values. The decode
 * kernel takes (rows, Hq, D) contiguous, so the one-row sequences' q heads are copied side by side
 * first (as the layer-by-layer path indexes them), and their outputs copied back to their rows. */
static int attend(const Kernels *kn, const Shape *sh, const Layer *L, const Step *st, const uint16_t *qkv,
                  const uint16_t *qk, uint16_t *q, uint16_t *attn) {
    const int D = sh->head_dim, Hq = sh->heads, Hkv = sh->kv_heads;
    const int64_t qk_width = (int64_t)(Hq + Hkv) * D, qkv_width = qk_width + (int64_t)Hkv * D, width = (int64_t)Hq * D;
    const Prompts *p = st->prompts;
    if (!p) {
        for (int r = 0; r < st->rows; r++) memcpy(q + r * width, qk + r * qk_width, sizeof(uint16_t) * width);
        return kn->attention(q, L->k_cache, L->v_cache, attn, st->context_lens, st->block_tables, sh->num_slots,
                             st->rows, Hq, Hkv, D, sh->block_size, st->max_blocks, 1, sh->scale, L->kv_kind,
                             L->k_scale, L->v_scale);
    }
    int status = 0;
    if (p->decodes) {
        uint16_t *out = q + (int64_t)p->decodes * width;
        for (int i = 0; i < p->decodes; i++)
            memcpy(q + i * width, qk + p->decode_rows[i] * qk_width, sizeof(uint16_t) * width);
        if ((status = kn->attention(q, L->k_cache, L->v_cache, out, p->context_lens, p->block_tables, sh->num_slots,
                                    p->decodes, Hq, Hkv, D, sh->block_size, p->max_blocks, 1, sh->scale, L->kv_kind,
                                    L->k_scale, L->v_scale)))
            return status;
        for (int i = 0; i < p->decodes; i++)
            memcpy(attn + p->decode_rows[i] * width, out + i * width, sizeof(uint16_t) * width);
    }
    for (int i = 0; i < p->count && status == 0; i++) {
        const int64_t r = p->starts[i];
        const int64_t *slots = p->key_slots[i];
        if (L->kv_kind) { /* a fresh prompt's own rows are in the cache already, at its rows' slots */
            status = attend_8bit(kn, sh, L, slots ? slots : st->slots + r, qk + r * qk_width, qk_width,
                                 attn + r * width, width, p->lens[i], p->keys[i]);
            continue;
        }
        const uint16_t *k = slots ? L->k_cache : qk + r * qk_width + width;
        const uint16_t *v = slots ? L->v_cache : qkv + r * qkv_width + qk_width;
        status = kn->prefill(qk + r * qk_width, qk_width, k, slots ? 0 : qk_width, v, slots ? 0 : qkv_width, slots,
                             sh->num_slots, attn + r * width, width, p->lens[i], p->keys[i], Hq, Hkv, D, sh->scale);
    }
    return status;
}

/* hidden: (rows, hidden) bf16, the embeddings in, the last layer's output out (in place). Returns
 * 0; or < 0, with hidden undefined: -1 a shape the kernels do not take, -2 no memory, or a
 * kernel's own failure status. */
int run_layers(const Kernels *kn, const Shape *sh, const Layer *layers, int num_layers, const Step *st,
               uint16_t *hidden) {
    const int m = st->rows, H = sh->hidden, D = sh->head_dim, Hq = sh->heads, Hkv = sh->kv_heads;
    const int64_t qk_width = (int64_t)(Hq + Hkv) * D, qkv_width = qk_width + (int64_t)Hkv * D;
    const int64_t I = sh->intermediate;
    const LoraRows *lora = st->lora;
    if (m < 1 || m > kn->max_rows || I % 16 || (st->prompts && !kn->prefill) || (lora && !kn->sgmv)) return -1;
    const int64_t *keep = st->keep;
    if (keep && (lora || st->keep_count < 0 || st->keep_count > m)) return -1;
    for (int i = 0; keep && i < st->keep_count; i++)
        if (keep[i] < i || keep[i] >= m || (i && keep[i] <= keep[i - 1])) return -1;
    size_t elems = (size_t)m * (H + qkv_width + qk_width + 3 * (size_t)Hq * D + H + 2 * I + I + H + (keep ? H : 0));
    uint16_t *buf = malloc(elems * sizeof(uint16_t));
    if (!buf) return -2;
    uint16_t *normed = buf, *qkv = normed + (size_t)m * H, *qk = qkv + m * qkv_width, *q = qk + m * qk_width,
             *attn = q + 2 * (size_t)m * Hq * D, *o = attn + (size_t)m * Hq * D, *gate_up = o + (size_t)m * H,
             *act = gate_up + 2 * m * I, *down = act + m * I, *kept = down + (size_t)m * H;
    const int64_t width = (int64_t)Hq * D;
    int status = 0;
    for (int l = 0; l < num_layers && status == 0; l++) {
        const Layer *L = &layers[l];
        /* The rows this layer's output projection and MLP run on: every row, but in the last layer with keep
         * only the wanted ones, gathered into `kept`. The others' keys and values are in the cache by then,
         * which is all later steps read of them. */
        const int last = keep && l == num_layers - 1;
        const int n = last ? st->keep_count : m;
        uint16_t *x = last ? kept : hidden;
        kn->norm(hidden, H, 1, L->input_norm, 1, normed, m, H, sh->eps, 1);
        if ((status = linear(kn, L->qkv_amx, normed, L->qkv, L->qkv_scale, L->fp8, qkv, m, qkv_width, H))) break;
        if ((status = add_lora(kn, &L->lora[0], lora, qkv, normed, H, qkv_width))) break;
        /* q and k heads normalised and rotated as one (rows, Hq + Hkv, D) block, as qwen3.py does. */
        kn->norm_rope(qkv, qkv_width, Hq + Hkv, L->qk_norm, Hq + Hkv, st->cos, st->signed_sin, qk,
                      (int64_t)m * (Hq + Hkv), D, sh->eps, 1);
        if ((status = kn->write_kv(qk + (int64_t)Hq * D, qkv + qk_width, qk_width, qkv_width, L->k_cache,
                                   L->v_cache, st->slots, m, Hkv, sh->num_slots, D, 2, L->kv_kind, L->k_scale,
                                   L->v_scale)))
            break;
        if ((status = attend(kn, sh, L, st, qkv, qk, q, attn))) break;
        if (last) {
            if (!n) break; /* no row of this step is wanted: its keys and values were all it was for */
            for (int i = 0; i < n; i++) { /* keep[i] >= i, ascending: no row is overwritten before it is read */
                memmove(attn + i * width, attn + keep[i] * width, sizeof(uint16_t) * width);
                memcpy(kept + (int64_t)i * H, hidden + keep[i] * H, sizeof(uint16_t) * H);
            }
        }
        if ((status = linear(kn, L->o_amx, attn, L->o, L->o_scale, L->fp8, o, n, H, width))) break;
        if ((status = add_lora(kn, &L->lora[1], lora, o, attn, width, H))) break;
        add_rows(x, o, (int64_t)n * H);
        kn->norm(x, H, 1, L->post_norm, 1, normed, n, H, sh->eps, 1);
        /* As VnniLinearMethod.apply_silu_and_mul, the same bits; not with adapter rows, whose products go in
         * before the activation (as MergedColumnParallelLinear.silu_and_mul declines them). */
        if (kn->linear_silu && !L->gate_up_scale && !(lora && L->lora[2].a)) {
            if ((status = kn->linear_silu(normed, L->gate_up, act, n, I, H))) break;
        } else {
            if ((status = linear(kn, L->gate_up_amx, normed, L->gate_up, L->gate_up_scale, L->fp8, gate_up, n, 2 * I,
                                 H)))
                break;
            if ((status = add_lora(kn, &L->lora[2], lora, gate_up, normed, H, 2 * I))) break;
            if ((status = silu_and_mul(gate_up, act, n, I))) break;
        }
        if ((status = linear(kn, L->down_amx, act, L->down, L->down_scale, L->fp8, down, n, H, I))) break;
        if ((status = add_lora(kn, &L->lora[3], lora, down, act, I, H))) break;
        add_rows(x, down, (int64_t)n * H);
        for (int i = 0; last && i < n; i++) memcpy(hidden + keep[i] * H, kept + (int64_t)i * H, sizeof(uint16_t) * H);
    }
    free(buf);
    return status;
}
