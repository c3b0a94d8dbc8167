"""The decode kernel's bf16 paths: rows read by stride over a run of blocks give the bits of rows looked up
block by block, and head size 16 (its own vector path) stays within one bf16 rounding of float64."""
import pathlib
import platform
import random

import pytest
import torch

from bench.cpu_kind import cpu_fields
from services.model_worker.kernels import cpu_attention

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def kernel():
    library = cpu_attention.load()
    assert library is not None, "the C kernel must build here (gcc is part of the test machine)"
    return library


def laid_out(keys: list[torch.Tensor], values: list[torch.Tensor], tables: list[list[int]], num_blocks: int):
    """Caches (Hkv, slots, D) holding each sequence's (ctx, Hkv, D) rows at its table's slots, and the table tensor."""
    kv_heads, head_dim = keys[0].shape[1:]
    k_cache = torch.zeros(kv_heads, num_blocks * BLOCK_SIZE, head_dim, dtype=keys[0].dtype)
    v_cache = torch.zeros_like(k_cache)
    for k, v, table in zip(keys, values, tables):
        pos = torch.arange(k.shape[0])
        slots = torch.tensor(table)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        k_cache[:, slots], v_cache[:, slots] = k.transpose(0, 1), v.transpose(0, 1)
    width = max(map(len, tables))
    return k_cache, v_cache, torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def random_sequences(contexts: list[int], kv_heads: int, head_dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(c, kv_heads, head_dim, generator=gen).bfloat16() for c in contexts]
    values = [torch.randn(c, kv_heads, head_dim, generator=gen).bfloat16() for c in contexts]
    return keys, values


@pytest.fixture(params=[1, 0], ids=["fetched", "unfetched"])
def fetching(kernel, request):
    """Strided rows fetched ahead by the kernel, and left to the hardware: each CPU takes one (its family), and
    both must give the same bits on any CPU."""
    kernel.paged_attention_set_prefetch_runs(request.param)
    assert kernel.paged_attention_prefetch_runs() == request.param
    yield request.param
    kernel.paged_attention_set_prefetch_runs(-1)


@pytest.mark.skipif(platform.machine() != "x86_64" or not pathlib.Path("/proc/cpuinfo").exists(),
                    reason="CPUID families are x86's")
def test_strided_rows_are_fetched_ahead_except_on_amd_family_25(kernel):
    """AMD's family 25 (Zen 4) read strided rows fastest without the kernel's fetches; other CPUs with them."""
    kernel.paged_attention_set_prefetch_runs(-1)
    fields = cpu_fields()  # /proc/cpuinfo's: the kernel reads CPUID itself
    vendor, family = fields["vendor_id"], int(fields["cpu family"])
    assert kernel.paged_attention_prefetch_runs() == int(not (vendor == "AuthenticAMD" and family == 25))


@pytest.mark.parametrize("head_dim", [16, 32, 64, 96])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_rows_read_by_stride_equal_rows_looked_up(kernel, fetching, head_dim, group):
    """The same sequences in one run of blocks each, in shuffled blocks, in runs broken once (so one chunk is
    read by stride and a later one looked up, or run by run), and with each first block apart from its run: the
    same bits."""
    kv_heads, contexts = 2, [1, 15, 16, 17, 80, 150, 256, 257, 300, 600]
    keys, values = random_sequences(contexts, kv_heads, head_dim, head_dim * 10 + group)
    counts = [-(-c // BLOCK_SIZE) + 1 for c in contexts]  # one block of room, as the block manager keeps
    num_blocks = sum(counts) + 8
    runs, at = [], 0
    for c in counts:
        runs.append(list(range(at, at + c)))
        at += c
    ids = list(range(num_blocks))
    random.Random(group).shuffle(ids)
    shuffled, at = [], 0
    for c in counts:
        shuffled.append(ids[at:at + c])
        at += c
    # Each table's run broken after its 18th block (past the first 256-key chunk): the rest in a second pool.
    broken = [t[:18] + [b + num_blocks for b in t[18:]] for t in runs]
    broken_blocks = 2 * num_blocks
    # Each table's first block apart from the rest of its run, as a cached prompt start's is.
    apart = [[t[0] + num_blocks] + t[1:] for t in runs]
    q = torch.randn(len(contexts), kv_heads * group, head_dim, generator=torch.Generator().manual_seed(1)).bfloat16()
    lens = torch.tensor(contexts, dtype=torch.int32)
    outs = []
    for tables, blocks in ((runs, num_blocks), (shuffled, num_blocks), (broken, broken_blocks), (apart, broken_blocks)):
        k_cache, v_cache, table = laid_out(keys, values, tables, blocks)
        outs.append(cpu_attention.paged_decode_attention(kernel, q, k_cache, v_cache, lens, table, BLOCK_SIZE,
                                                         head_dim ** -0.5))
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert torch.equal(outs[0].view(torch.int16), outs[2].view(torch.int16))
    assert torch.equal(outs[0].view(torch.int16), outs[3].view(torch.int16))


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("shuffled", [False, True], ids=["runs", "shuffled"])
def test_head_size_16_in_bf16_within_one_rounding_of_float64(kernel, fetching, group, shuffled):
    kv_heads, contexts = 2, [1, 2, 5, 16, 33, 80, 150, 255, 256, 257, 513]
    keys, values = random_sequences(contexts, kv_heads, 16, group)
    counts = [-(-c // BLOCK_SIZE) for c in contexts]
    ids = list(range(sum(counts)))
    if shuffled:
        random.Random(group).shuffle(ids)
    tables, at = [], 0
    for c in counts:
        tables.append(ids[at:at + c])
        at += c
    k_cache, v_cache, table = laid_out(keys, values, tables, len(ids))
    q = torch.randn(len(contexts), kv_heads * group, 16, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = cpu_attention.paged_decode_attention(kernel, q, k_cache, v_cache, torch.tensor(contexts, dtype=torch.int32),
                                               table, BLOCK_SIZE, 0.25)
    for b in range(len(contexts)):
        k = keys[b].double().transpose(0, 1).repeat_interleave(group, 0)  # (H, ctx, D)
        v = values[b].double().transpose(0, 1).repeat_interleave(group, 0)
        weights = (torch.einsum("hd,hcd->hc", q[b].double(), k) * 0.25).softmax(-1)
        expected = torch.einsum("hc,hcd->hd", weights, v)
        assert (out[b].double() - expected).abs().max().item() <= 2 ** -8 * 4 + 1e-3, (b, contexts[b])
