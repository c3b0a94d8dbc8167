"""The prefill attention kernel (AMX tiles, or AVX512-BF16 register tiles without AMX) against a float64
reference, and how the CPU backend routes prompts to it."""
import random

import pytest
import torch
import torch.nn.functional as F

from services.model_worker.kernels import cpu_attention, cpu_prefill_attention
from services.model_worker.model.layers.attention.cpu_paged import CpuPagedAttention
from services.model_worker.model.layers.attention.dispatch import paged_attention
from services.model_worker.model.layers.attention.metadata import AttentionMetadata

BLOCK = 16


@pytest.fixture(scope="module")
def library():
    library = cpu_prefill_attention.load()
    if library is None:
        pytest.skip("needs a CPU with AVX512-BF16 (and, with AMX, an OS that grants its tile state)")
    return library


@pytest.fixture(scope="module")
def backend(library):
    return CpuPagedAttention(cpu_attention.load(), library)


def reference(q, keys, values, first_pos):
    """q: (Lq, H, D) at positions first_pos..; keys, values: (L, Hkv, D) at 0..L-1. float64, causal."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1).double(), values.repeat_interleave(group, 1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * q.shape[2] ** -0.5
    visible = torch.arange(keys.shape[0])[None, :] <= first_pos + torch.arange(q.shape[0])[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), values)


def step(cases, heads, kv_heads, head_dim, seed=0):
    """Caches and this step's rows for (context, new tokens) per sequence, their blocks scattered.

    Sequence i's keys, values and queries depend only on the seed and the sequences before it.
    """
    gen = torch.Generator().manual_seed(seed)
    seqs = [(torch.randn(context, heads, head_dim, generator=gen).bfloat16()[context - q_len:],
             torch.randn(context, kv_heads, head_dim, generator=gen).bfloat16(),
             torch.randn(context, kv_heads, head_dim, generator=gen).bfloat16()) for context, q_len in cases]
    blocks = sum(-(-context // BLOCK) for context, _ in cases)
    free = random.Random(seed).sample(range(blocks + 8), blocks)
    k_cache = torch.randn(kv_heads, (blocks + 8) * BLOCK, head_dim, generator=gen).bfloat16()  # stale data
    v_cache = torch.randn(kv_heads, (blocks + 8) * BLOCK, head_dim, generator=gen).bfloat16()
    tables = []
    for (context, q_len), (_, keys, values) in zip(cases, seqs):
        table = [free.pop() for _ in range(-(-context // BLOCK))]
        for pos in range(context - q_len):  # what earlier steps wrote
            slot = table[pos // BLOCK] * BLOCK + pos % BLOCK
            k_cache[:, slot], v_cache[:, slot] = keys[pos], values[pos]
        tables.append(table)
    # q, k and v as the model hands them over: views of one fused projection, rows strided.
    width = (heads + 2 * kv_heads) * head_dim
    fused = torch.zeros(sum(q_len for _, q_len in cases), width, dtype=torch.bfloat16)
    row = 0
    for (context, q_len), (q, keys, values) in zip(cases, seqs):
        fused[row:row + q_len] = torch.cat([q.flatten(1), keys[context - q_len:].flatten(1),
                                            values[context - q_len:].flatten(1)], dim=1)
        row += q_len
    q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = (t.view(-1, t.shape[1] // head_dim, head_dim) for t in (q, k, v))
    return tables, seqs, q, k, v, k_cache, v_cache


def attend(backend, cases, heads, kv_heads, head_dim, seed=0):
    tables, seqs, q, k, v, k_cache, v_cache = step(cases, heads, kv_heads, head_dim, seed)
    meta = AttentionMetadata.build(tables, [c[0] for c in cases], [c[1] for c in cases], BLOCK,
                                   torch.device("cpu"), backend)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, head_dim ** -0.5)
    expected = torch.cat([reference(sq, keys, values, context - q_len)
                          for (context, q_len), (sq, keys, values) in zip(cases, seqs)])
    return out, expected


# (context after the step, new tokens) per sequence.
STEPS = {
    "one-prompt": [(128, 128)],
    "ragged-prompts": [(37, 37), (16, 16), (2, 2), (77, 77)],
    "chunk-after-cache": [(200, 49)],
    "prefix-hit": [(4 * BLOCK + 5, 5)],
    "with-decodes": [(40, 1), (90, 90), (17, 1), (130, 30)],
}


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4])  # 3: query heads in a pair and one alone
@pytest.mark.parametrize("name", list(STEPS))
def test_matches_float64_within_bf16_rounding(backend, name, group, head_dim):
    out, expected = attend(backend, STEPS[name], 2 * group, 2, head_dim)
    assert out.shape == expected.shape
    # Averages of N(0, 1) values (|x| < 4): the weights' and the output's bf16 roundings.
    assert (out.double() - expected).abs().max().item() <= 2 ** -8 * 4 + 1e-3


def test_as_close_as_sdpa_at_the_0_6b_shape(library):
    """16 query heads over 8 KV heads of 128, 512 tokens: no further from float64 than SDPA is."""
    _, seqs, q, k, v, *_ = step([(512, 512)], 16, 8, 128, seed=5)
    out = cpu_prefill_attention.prefill_attention(library, q, k, v, 128 ** -0.5, torch.empty_like(q))
    expected = reference(*seqs[0], 0)
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                          is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    ours, theirs = ((t.double() - expected).abs() for t in (out, sdpa))
    assert ours.max() <= theirs.max() * 1.05 and ours.mean() <= theirs.mean() * 1.05


def test_every_prompt_of_a_step_takes_the_kernel(backend, monkeypatch):
    calls = []
    original = cpu_prefill_attention.prefill_attention
    monkeypatch.setattr(cpu_prefill_attention, "prefill_attention",
                        lambda *args, **kwargs: calls.append(args[1].shape[0]) or original(*args, **kwargs))
    attend(backend, STEPS["with-decodes"], 4, 2, 64)
    assert calls == [90, 30]  # the two prompts, not the decodes


def test_float32_and_odd_head_sizes_take_sdpa(library):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, 2, 32, generator=gen) for _ in range(3))
    cache = torch.zeros(2, 64, 32)
    assert not cpu_prefill_attention.supports(q, k, v, cache, cache)
    q, k, v, cache = (t.bfloat16() for t in (q, k, v, cache))
    assert cpu_prefill_attention.supports(q, k, v, cache, cache)
    assert not cpu_prefill_attention.supports(q[..., :16], k[..., :16], v[..., :16], cache[..., :16], cache[..., :16])


def test_a_prompt_gets_the_same_bits_alone_in_a_batch_and_chunked(backend):
    """Each row's arithmetic is its own: the same bits with neighbours in the step, and for a prompt's
    last rows whether it is prefilled whole or its earlier rows come from the cache."""
    whole, _ = attend(backend, [(150, 150)], 4, 2, 128, seed=3)
    crowded, _ = attend(backend, [(150, 150), (60, 60), (31, 1), (9, 9)], 4, 2, 128, seed=3)
    assert torch.equal(whole, crowded[:150])
    # The same prompt after its first 109 tokens were cached: the queries are drawn whole and cut.
    chunked, expected = attend(backend, [(150, 41)], 4, 2, 128, seed=3)
    assert torch.equal(chunked, whole[109:])
    assert (chunked.double() - expected).abs().max().item() <= 2 ** -8 * 4 + 1e-3


def test_a_slot_outside_the_cache_is_refused(library):
    q = torch.zeros(4, 2, 32, dtype=torch.bfloat16)
    cache = torch.zeros(2, 64, 32, dtype=torch.bfloat16)
    with pytest.raises(IndexError):
        cpu_prefill_attention.prefill_attention(library, q, cache, cache, 1.0, torch.empty_like(q),
                                                torch.tensor([0, 1, 2, 64]))
