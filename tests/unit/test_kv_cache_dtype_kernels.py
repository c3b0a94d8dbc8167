"""The 8-bit KV cache's kernels: the C cache write quantizes bit for bit as kv_quant's torch arithmetic does, and
the C decode kernel (and the torch backend) reading fp8 and int8 caches match a float64 reference of the same
dequantization, over head sizes, GQA ratios, block sizes and context lengths."""
import pytest
import torch

from services.model_worker.kernels import cpu_attention
from services.model_worker.model.layers.attention import kv_quant
from services.model_worker.model.layers.attention.cpu_paged import CpuPagedAttention
from services.model_worker.model.layers.attention.sdpa import TorchAttention

KINDS = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}


@pytest.fixture(scope="module")
def kernel():
    library = cpu_attention.load()
    assert library is not None, "the C kernel must build here (gcc is part of the test machine)"
    return library


def empty_cache(kind: str, kv_heads: int, slots: int, head_dim: int, fp8_scale: float = 1.0):
    dtype = KINDS[kind]
    k_cache = torch.zeros(kv_heads, slots, head_dim, dtype=dtype)
    if kind == "fp8":
        scales = torch.tensor([fp8_scale]), torch.tensor([fp8_scale * 0.5])
    else:
        scales = torch.zeros(kv_heads, slots), torch.zeros(kv_heads, slots)
    return k_cache, torch.zeros_like(k_cache), *scales


def reference_quantize(x: torch.Tensor, kind: str, scale: float | None):
    """The contract's arithmetic written out again in float32: (q, per-row scale or None)."""
    x = x.float()
    if kind == "fp8":
        return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn), None
    s = x.abs().amax(-1) / 127
    safe = torch.where(s == 0, torch.ones_like(s), s)
    return torch.round(x / safe[..., None]).to(torch.int8), s


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [16, 24, 64, 128])
def test_c_write_matches_torch_bit_for_bit(kernel, kind, dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    tokens, kv_heads, slots = 37, 3, 64
    k = (torch.randn(tokens, kv_heads, head_dim, generator=gen) * 30).to(dtype)
    v = (torch.randn(tokens, kv_heads, head_dim, generator=gen) * 0.01).to(dtype)
    k[3, 1] = 0  # a zero row: int8 scale 0, q 0
    k[4, 0, :4] = torch.tensor([1e4, -1e4, 2.5, -2.5])  # clamped for fp8; ties for int8 rounding
    slot_mapping = torch.randperm(slots, generator=gen)[:tokens]
    c_caches = empty_cache(kind, kv_heads, slots, head_dim, fp8_scale=0.75)
    t_caches = tuple(t.clone() for t in c_caches)
    assert cpu_attention.can_write_kv(k, v, *c_caches[:2], slot_mapping, *c_caches[2:])
    CpuPagedAttention(kernel).write_kv(k, v, c_caches[0], c_caches[1], slot_mapping, k_scale=c_caches[2],
                                       v_scale=c_caches[3])
    kv_quant.write_kv(k, v, *t_caches[:2], slot_mapping, *t_caches[2:])
    for c, t in zip(c_caches, t_caches):
        assert torch.equal(c.view(torch.uint8) if c.dtype != torch.float32 else c,
                           t.view(torch.uint8) if t.dtype != torch.float32 else t)
    # and both as the contract states it
    q, s = reference_quantize(k, kind, 0.75)
    assert torch.equal(c_caches[0][:, slot_mapping].view(torch.uint8), q.transpose(0, 1).view(torch.uint8))
    if s is not None:
        assert torch.equal(c_caches[2][:, slot_mapping], s.transpose(0, 1))
        assert (c_caches[2][1, slot_mapping[3]] == 0) and (c_caches[0][1, slot_mapping[3]] == 0).all()


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_c_write_every_bf16_value(kernel, kind):
    """All 65,536 bf16 bit patterns but NaN and inf, 16 a row: fp8's conversion (normals, subnormals, ties,
    clamping) and int8's rounding equal torch's everywhere."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    values = bits[torch.isfinite(bits.float())]
    values = values[: values.numel() // 16 * 16].reshape(-1, 1, 16)
    slots = torch.arange(values.shape[0])
    c_caches = empty_cache(kind, 1, values.shape[0], 16)
    t_caches = tuple(t.clone() for t in c_caches)
    cpu_attention.write_kv(kernel, values, values, *c_caches[:2], slots, *c_caches[2:])
    kv_quant.write_kv(values, values, *t_caches[:2], slots, *t_caches[2:])
    assert torch.equal(c_caches[0].view(torch.uint8), t_caches[0].view(torch.uint8))
    assert torch.equal(c_caches[1].view(torch.uint8), t_caches[1].view(torch.uint8))
    assert torch.equal(c_caches[2], t_caches[2])


def filled_caches(kind, contexts, kv_heads, head_dim, block_size, seed):
    """8-bit caches holding random sequences through shuffled block tables: (caches, table tensor)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-c // block_size) for c in contexts]
    num_blocks = sum(counts) + 3
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    caches = empty_cache(kind, kv_heads, num_blocks * block_size, head_dim, fp8_scale=0.5)
    tables, at = [], 0
    for c, n in zip(contexts, counts):
        table = ids[at:at + n]
        at += n
        tables.append(table)
        pos = torch.arange(c)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        k = torch.randn(c, kv_heads, head_dim, generator=gen).bfloat16()
        v = torch.randn(c, kv_heads, head_dim, generator=gen).bfloat16()
        kv_quant.write_kv(k, v, *caches[:2], slots, *caches[2:])
    width = max(counts)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return caches, table


def reference_decode(q, caches, contexts, table, block_size, scale):
    """float64 attention over the dequantized rows: float64(q) * scale, as the contract reads them."""
    k_cache, v_cache, k_scale, v_scale = caches
    out = torch.empty(q.shape, dtype=torch.float64)
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    for b, c in enumerate(contexts):
        pos = torch.arange(c)
        slots = table[b].long()[pos // block_size] * block_size + pos % block_size
        keys = k_cache[:, slots].double() * (k_scale.double() if k_scale.dim() == 1 else k_scale[:, slots, None].double())
        values = v_cache[:, slots].double() * (v_scale.double() if v_scale.dim() == 1 else v_scale[:, slots, None].double())
        keys = keys.repeat_interleave(heads // kv_heads, 0)
        values = values.repeat_interleave(heads // kv_heads, 0)
        scores = torch.einsum("hd,hkd->hk", q[b].double(), keys) * scale
        out[b] = torch.einsum("hk,hkd->hd", scores.softmax(-1), values)
    return out


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("head_dim,group,block_size", [(16, 1, 16), (32, 2, 16), (64, 4, 5), (128, 2, 16),
                                                       (128, 8, 1), (256, 1, 16), (24, 2, 16), (48, 3, 7),
                                                       (128, 16, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_c_decode_matches_float64_reference(kernel, kind, head_dim, group, block_size, dtype):
    """Contexts around the kernel's 16-key steps and 256-key chunks; the fast path (head sizes a multiple of 16,
    groups 1-8) and the general one (24, group 3, group 16) alike."""
    contexts, kv_heads = [1, 7, 16, 33, 256, 300, 600], 2
    caches, table = filled_caches(kind, contexts, kv_heads, head_dim, block_size, head_dim + group)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(contexts), kv_heads * group, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    lens = torch.tensor(contexts, dtype=torch.int32)
    out = cpu_attention.paged_decode_attention(kernel, q, caches[0], caches[1], lens, table, block_size, scale,
                                               caches[2], caches[3])
    expected = reference_decode(q, caches, contexts, table, block_size, scale)
    assert out.dtype == dtype
    # bf16 output: one rounding (2^-8 relative) of values of size ~1; float32: float32 sums over 600 keys
    tolerance = 1e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)
    torch_out = TorchAttention().decode(q, caches[0], caches[1], lens, table, block_size, scale,
                                        k_scale=caches[2], v_scale=caches[3])
    torch.testing.assert_close(torch_out.double(), expected, atol=2 * tolerance, rtol=2 * tolerance)


def every_byte_caches(kind, kv_heads, slots, head_dim, seed):
    """8-bit caches of random bytes, every value the format has (int8 -128 included; fp8 bar its NaN bytes),
    with random scales (int8: one a row)."""
    gen = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(2):
        raw = torch.randint(-128, 128, (kv_heads, slots, head_dim), generator=gen, dtype=torch.int8)
        if kind == "fp8":
            raw = torch.where((raw == 0x7f) | (raw == -1), torch.zeros_like(raw), raw).view(torch.float8_e4m3fn)
        caches.append(raw)
    if kind == "fp8":
        scales = [torch.tensor([0.01]), torch.tensor([0.02])]
    else:
        scales = [torch.rand(kv_heads, slots, generator=gen) * 0.05 + 1e-3 for _ in range(2)]
    return caches + scales


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("head_dim,group,block_size", [(64, 1, 16), (64, 2, 1), (128, 2, 7), (128, 8, 5),
                                                       (256, 4, 16), (256, 1, 3), (96, 2, 16)])
@pytest.mark.parametrize("layout", ["runs", "scattered", "apart"])
def test_c_decode_every_byte_on_runs_and_scattered_blocks(kernel, kind, head_dim, group, block_size, layout):
    """A bf16 query over every byte value: each sequence's blocks one run of ids (rows read by stride), shuffled,
    or one run but for its first block, kept apart (as a cached prompt start's), odd block sizes breaking the
    16-key steps and 256-key chunks; head sizes 64, 128, 256 (and 96)."""
    contexts, kv_heads = [1, 17, 255, 300, 700], 2
    counts = [-(-c // block_size) + 1 for c in contexts]
    gen = torch.Generator().manual_seed(head_dim * group + block_size)
    ids = list(range(sum(counts)))
    if layout == "scattered":
        ids = torch.randperm(len(ids), generator=gen).tolist()
    tables, at = [], 0
    for i, n in enumerate(counts):
        tables.append(ids[at:at + n])
        if layout == "apart":
            tables[-1][0] = sum(counts) + i
        at += n
    table = torch.tensor([t + [0] * (max(counts) - len(t)) for t in tables], dtype=torch.int32)
    caches = every_byte_caches(kind, kv_heads, (sum(counts) + len(counts)) * block_size, head_dim, seed=block_size)
    q = torch.randn(len(contexts), kv_heads * group, head_dim, generator=gen).bfloat16()
    scale = head_dim ** -0.5
    out = cpu_attention.paged_decode_attention(kernel, q, caches[0], caches[1], torch.tensor(contexts, dtype=torch.int32),
                                               table, block_size, scale, caches[2], caches[3])
    expected = reference_decode(q, caches, contexts, table, block_size, scale)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("head_dim,group", [(128, 2), (64, 4), (128, 8)])
@pytest.mark.parametrize("sink_at", [0, 5, 15])
def test_int8_sink_with_small_values_beside_large_ones_keeps_its_precision(kernel, head_dim, group, sink_at):
    """One key of a 16-key step takes nearly all the weight while its value row's scale is 10^-4 of its
    neighbours' (an attention sink): the output, about that row's small values, stays within bf16's rounding of
    the float64 reference, relative to its own size."""
    kv_heads, context = 2, 16
    gen = torch.Generator().manual_seed(head_dim + group + sink_at)
    raw_k = torch.randint(-20, 21, (kv_heads, context, head_dim), generator=gen, dtype=torch.int8)
    signs = torch.randint(0, 2, (kv_heads, head_dim), generator=gen) * 2 - 1
    raw_k[:, sink_at] = (signs * 127).to(torch.int8)
    raw_v = torch.randint(-127, 128, (kv_heads, context, head_dim), generator=gen, dtype=torch.int8)
    k_scale = torch.full((kv_heads, context), 0.05)
    v_scale = torch.full((kv_heads, context), 1.0)
    v_scale[:, sink_at] = 1e-4
    # every query head along its KV head's sink key
    q = (torch.rand(1, kv_heads * group, head_dim, generator=gen) + 0.5) * signs.repeat_interleave(group, 0)
    caches = [raw_k, raw_v, k_scale, v_scale]
    table = torch.tensor([[0]], dtype=torch.int32)
    scale = head_dim ** -0.5
    lens = torch.tensor([context], dtype=torch.int32)
    out = cpu_attention.paged_decode_attention(kernel, q.bfloat16(), raw_k, raw_v, lens, table, context, scale,
                                               k_scale, v_scale)
    expected = reference_decode(q.bfloat16(), caches, [context], table, context, scale)
    sink_share = torch.einsum("hd,hkd->hk", q.bfloat16()[0].double(),
                              (raw_k.double() * 0.05).repeat_interleave(group, 0)).mul(scale).softmax(-1)[:, sink_at]
    assert (sink_share > 0.999).all()  # the case meant: the sink's row all but alone
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-5)


def test_fp8_scales_fold_into_the_kernel(kernel):
    """A per-layer fp8 scale of 4 against 1 on rows stored 4x smaller: the same attention."""
    contexts, head_dim = [40, 70], 64
    gen = torch.Generator().manual_seed(3)
    caches, table = filled_caches("fp8", contexts, 2, head_dim, 16, 5)
    q = torch.randn(2, 4, head_dim, generator=gen).bfloat16()
    lens = torch.tensor(contexts, dtype=torch.int32)
    base = cpu_attention.paged_decode_attention(kernel, q, caches[0], caches[1], lens, table, 16, 0.125,
                                                caches[2], caches[3])
    # Every stored e4m3 value divided by 4 is exact (bar subnormals): dequantized values stay the same.
    shrunk = [(c.float() / 4).to(torch.float8_e4m3fn) for c in caches[:2]]
    exact = all(torch.equal(s.float() * 4, c.float()) for s, c in zip(shrunk, caches[:2]))
    scaled = cpu_attention.paged_decode_attention(kernel, q, *shrunk, lens, table, 16, 0.125, caches[2] * 4,
                                                  caches[3] * 4)
    if exact:
        assert torch.equal(base, scaled)
    else:
        torch.testing.assert_close(base.float(), scaled.float(), atol=2e-2, rtol=2e-2)
    assert not torch.equal(base, cpu_attention.paged_decode_attention(kernel, q, *caches[:2], lens, table, 16, 0.125,
                                                                      caches[2] * 2, caches[3]))


def backends() -> dict:
    from services.model_worker.kernels import cpu_prefill_attention, triton_attention
    from services.model_worker.model.layers.attention.triton_paged import TritonPagedAttention

    found = {"torch": TorchAttention(), "cpu-paged": CpuPagedAttention(cpu_attention.load(),
                                                                      cpu_prefill_attention.load())}
    if triton_attention.available():
        found["triton"] = TritonPagedAttention()
    return found


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("backend_name", ["torch", "cpu-paged", "triton"])
def test_every_backend_on_a_mixed_step_matches_float64_as_stored(kind, backend_name):
    """Decodes, a fresh prompt and a chunk after cached tokens in one step, through dispatch.paged_attention: the
    new rows are quantized into the cache, and every query attends to every key (its own prompt's too) as stored."""
    from services.model_worker.model.layers.attention.dispatch import paged_attention
    from services.model_worker.model.layers.attention.metadata import AttentionMetadata

    backend = backends().get(backend_name)
    if backend is None:
        pytest.skip(f"{backend_name} is not available here")
    block_size, kv_heads, heads, head_dim = 16, 2, 4, 64
    gen = torch.Generator().manual_seed(11)
    # (context after the step, new tokens): two decodes, a fresh 37-token prompt, 20 new after 45 cached
    cases = [(50, 1), (130, 1), (37, 37), (65, 20)]
    counts = [-(-c // block_size) for c, _ in cases]
    ids = torch.randperm(sum(counts) + 2, generator=gen).tolist()
    tables, at = [], 0
    for n in counts:
        tables.append(ids[at:at + n])
        at += n
    caches = empty_cache(kind, kv_heads, (sum(counts) + 2) * block_size, head_dim, fp8_scale=0.5)
    q_rows, new_k, new_v, keys_all, values_all = [], [], [], [], []
    for (context, new), table in zip(cases, tables):
        k = torch.randn(context, kv_heads, head_dim, generator=gen).bfloat16()
        v = torch.randn(context, kv_heads, head_dim, generator=gen).bfloat16()
        pos = torch.arange(context - new)
        slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        kv_quant.write_kv(k[:context - new], v[:context - new], *caches[:2], slots, *caches[2:])  # earlier steps
        q_rows.append(torch.randn(new, heads, head_dim, generator=gen).bfloat16())
        new_k.append(k[context - new:])
        new_v.append(v[context - new:])
        keys_all.append(k)
        values_all.append(v)
    meta = AttentionMetadata.build(tables, [c for c, _ in cases], [n for _, n in cases], block_size,
                                   torch.device("cpu"), backend)
    out = paged_attention(torch.cat(q_rows), torch.cat(new_k), torch.cat(new_v), caches[0], caches[1], meta,
                          head_dim ** -0.5, k_scale=caches[2], v_scale=caches[3])
    expected = []
    for (context, new), q, k, v in zip(cases, q_rows, keys_all, values_all):
        scale = caches[2][:1] if kind == "fp8" else None
        kq, ks = kv_quant.quantize(k, caches[0].dtype, scale)
        vq, vs = kv_quant.quantize(v, caches[1].dtype, caches[3][:1] if kind == "fp8" else None)
        kd = kq.double() * (caches[2].double() if kind == "fp8" else ks.double()[..., None])
        vd = vq.double() * (caches[3].double() if kind == "fp8" else vs.double()[..., None])
        kd, vd = kd.repeat_interleave(heads // kv_heads, 1), vd.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q.double(), kd) * head_dim ** -0.5
        query_pos = torch.arange(context - new, context)
        scores = scores.masked_fill(torch.arange(context)[None, :] > query_pos[:, None], float("-inf"))
        expected.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vd))
    torch.testing.assert_close(out.double(), torch.cat(expected), atol=3e-2, rtol=3e-2)
