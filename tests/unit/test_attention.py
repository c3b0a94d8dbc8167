"""Batched paged attention (both backends) against a float64 reference, over random mixes of step kinds."""
import os
import pathlib
import random

import pytest
import torch
import torch.nn.functional as F

from services.model_worker.kernels import build, cpu_attention, triton_attention
from services.model_worker.model.layers.attention import sdpa as sdpa_backend
from services.model_worker.model.layers.attention.cpu_paged import CpuPagedAttention
from services.model_worker.model.layers.attention.dispatch import paged_attention
from services.model_worker.model.layers.attention.metadata import AttentionMetadata
from services.model_worker.model.layers.attention.sdpa import TorchAttention
from services.model_worker.model.layers.attention.triton_paged import TritonPagedAttention

HEAD_DIM = 16
NUM_BLOCKS = 160


@pytest.fixture(scope="module")
def kernel():
    library = cpu_attention.load()
    assert library is not None, "the C kernel must build here (gcc is part of the test machine)"
    return library


@pytest.fixture(scope="module", params=["torch", "cpu-paged", "triton"])
def backend(request, kernel):
    if request.param == "triton":
        # The GPU backend's kernel, run by Triton's interpreter on CPU tensors (tests/conftest.py).
        assert triton_attention.available(), "triton is part of the test dependencies"
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("compiled Triton needs CUDA tensors: the cuda-marked test covers it")
        return TritonPagedAttention()
    return TorchAttention() if request.param == "torch" else CpuPagedAttention(kernel)


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int) -> torch.Tensor:
    """q: (Lq, H, D) at positions first_pos..; keys, values: (L, Hkv, D) at 0..L-1. float64, causal."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1).double(), values.repeat_interleave(group, 1).double()
    out = []
    for i in range(q.shape[0]):
        visible = first_pos + i + 1
        scores = torch.einsum("hd,lhd->hl", q[i].double(), keys[:visible]) * HEAD_DIM ** -0.5
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values[:visible]))
    return torch.stack(out)


def random_step(rng: random.Random, block_size: int, scattered: bool, num_seqs: int, kinds: list[str]):
    """(block table, context length after the step, new tokens) per sequence, no two sharing a block.

    Kinds: a prompt's first chunk, a later chunk (or a prefix-cache hit: cached whole blocks),
    a decode, a one-token prompt, a one-token chunk of a longer prompt.
    """
    free = list(range(NUM_BLOCKS))
    if scattered:
        rng.shuffle(free)
    cases = []
    for _ in range(num_seqs):
        kind = rng.choice(kinds)
        if kind == "prompt":
            q_len = rng.randrange(2, 70)
            context = q_len
        elif kind == "chunk":
            q_len, context = rng.randrange(2, 40), rng.randrange(1, 90)
            context += q_len
        elif kind == "prefix_hit":
            q_len = rng.randrange(2, 30)
            context = rng.randrange(1, 5) * block_size + q_len
        elif kind == "decode":
            q_len, context = 1, rng.randrange(2, 150)
        elif kind == "one_token_prompt":
            q_len = context = 1
        else:  # one-token chunk
            q_len, context = 1, rng.randrange(2, 60)
        room = rng.randrange(0, 3)  # blocks held past the context, as the block manager keeps room to grow
        count = -(-context // block_size) + room
        table = [free.pop() if scattered else free.pop(0) for _ in range(count)]
        cases.append((table, context, q_len))
    return cases


def run(backend, cases, block_size: int, heads: int, kv_heads: int, dtype=torch.float32, seed: int = 0,
        device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(kv_heads, NUM_BLOCKS * block_size, HEAD_DIM, generator=gen).to(dtype)  # stale data
    v_cache = torch.randn(kv_heads, NUM_BLOCKS * block_size, HEAD_DIM, generator=gen).to(dtype)
    seqs = []
    for table, context, q_len in cases:
        keys = torch.randn(context, kv_heads, HEAD_DIM, generator=gen).to(dtype)
        values = torch.randn(context, kv_heads, HEAD_DIM, generator=gen).to(dtype)
        q = torch.randn(q_len, heads, HEAD_DIM, generator=gen).to(dtype)
        for pos in range(context - q_len):  # what earlier steps wrote
            slot = table[pos // block_size] * block_size + pos % block_size
            k_cache[:, slot], v_cache[:, slot] = keys[pos], values[pos]
        seqs.append((q, keys, values))
    meta = AttentionMetadata.build([c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases],
                                   block_size, torch.device(device), backend)
    q = torch.cat([s[0] for s in seqs]).to(device)
    new_k = torch.cat([k[c[1] - c[2]:] for (_, k, _), c in zip(seqs, cases)]).to(device)
    new_v = torch.cat([v[c[1] - c[2]:] for (_, _, v), c in zip(seqs, cases)]).to(device)
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    out = paged_attention(q, new_k, new_v, k_cache, v_cache, meta, HEAD_DIM ** -0.5).cpu()
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    expected = torch.cat([reference(q_, k, v, c[1] - c[2]) for (q_, k, v), c in zip(seqs, cases)])
    return out, expected, k_cache, v_cache, seqs


MIXES = {
    "decode": ["decode"],
    "prefill": ["prompt"],
    "chunked_prefill": ["chunk", "one_token_chunk"],
    "prefix_hits": ["prefix_hit"],
    "everything": ["prompt", "chunk", "prefix_hit", "decode", "one_token_prompt", "one_token_chunk"],
}


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("scattered", [False, True], ids=["contiguous", "scattered"])
def test_batched_attention_matches_float64_reference(backend, mix, group, block_size, scattered):
    rng = random.Random(f"{mix}-{group}-{block_size}-{scattered}")
    kv_heads = 2 if group < 8 else 1
    cases = random_step(rng, block_size, scattered, rng.randrange(1, 7), MIXES[mix])
    out, expected, *_ = run(backend, cases, block_size, kv_heads * group, kv_heads)
    assert out.shape == expected.shape
    assert (out.double() - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("steps", [
    [([0, 1, 2, 3, 4], 37, 37)],                               # one fresh prompt: the whole step
    [([5, 6, 7], 21, 5)],                                      # one prompt after a prefix hit
    [([8], 6, 1), ([9, 10], 12, 1), ([11, 12, 13, 18], 30, 30)],  # decodes, then one prompt
    [([14, 15, 16, 19], 30, 30), ([17], 6, 1)],                # one prompt, then a decode
], ids=["prompt-alone", "prefix-hit-alone", "prompt-after-decodes", "prompt-before-decodes"])
def test_a_lone_prefill_reads_its_rows_in_place(backend, steps):
    """One prefilling sequence takes views of its rows instead of gathered copies; same results."""
    meta = AttentionMetadata.build([c[0] for c in steps], [c[1] for c in steps], [c[2] for c in steps], 8,
                                   torch.device("cpu"), TorchAttention())
    assert meta.prefill.single_start == sum(c[2] for c in steps[:[c[2] > 1 for c in steps].index(True)])
    out, expected, *_ = run(backend, steps, 8, 8, 2)
    assert (out.double() - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_bfloat16_within_its_rounding(backend, group):
    """bf16 in and out: the result is the float64 attention of the bf16 inputs, rounded once more."""
    rng = random.Random(group)
    cases = random_step(rng, 16, True, 8, MIXES["everything"])
    out, expected, *_ = run(backend, cases, 16, 2 * group, 2, torch.bfloat16)
    # Outputs are averages of N(0, 1) values: |x| < 4, so one bf16 rounding is within 2^-8 * 4.
    assert (out.double() - expected).abs().max().item() <= 2 ** -8 * 4 + 1e-3


def test_new_tokens_are_written_to_their_slots(backend):
    cases = random_step(random.Random(7), 8, True, 5, MIXES["everything"])
    _, _, k_cache, v_cache, seqs = run(backend, cases, 8, 4, 2)
    for (table, context, _), (_, keys, values) in zip(cases, seqs):
        for pos in range(context):
            slot = table[pos // 8] * 8 + pos % 8
            assert torch.equal(k_cache[:, slot], keys[pos]) and torch.equal(v_cache[:, slot], values[pos])


def test_a_sequence_gets_the_same_result_alone_and_in_any_batch(kernel):
    """The kernel's arithmetic for a sequence never depends on its neighbours: bit for bit."""
    backend = CpuPagedAttention(kernel)
    cases = random_step(random.Random(3), 16, True, 12, ["decode"])
    together, *_ = run(backend, cases, 16, 8, 2)
    for i, case in enumerate(cases):
        # The same inputs alone: run() draws them in order, so replay the ones before it and drop them.
        alone, *_ = run(backend, cases[:i + 1], 16, 8, 2)
        assert torch.equal(alone[-1], together[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kinds", [["prompt"], ["prompt", "chunk", "prefix_hit", "decode"]], ids=["prompts", "mixed"])
def test_a_prefill_gets_the_same_bits_alone_and_in_any_batch(backend, kinds, dtype):
    """Prompts of different lengths in one step (packed, no padding) equal each one alone, bit for bit."""
    # Triton's interpreter runs each program in Python: fewer sequences keep it to seconds.
    count = 3 if isinstance(backend, TritonPagedAttention) else 6
    cases = random_step(random.Random(f"alone-{kinds}"), 8, True, count, kinds)
    unused = sorted(set(range(NUM_BLOCKS)) - {block for case in cases for block in case[0]})
    cases.append((unused[:10], 75, 75))  # a longer prompt than the rest
    together, *_ = run(backend, cases, 8, 8, 2, dtype)
    row = 0
    for i, case in enumerate(cases):
        alone, *_ = run(backend, cases[:i + 1], 8, 8, 2, dtype)  # the same inputs: run() draws them in order
        n = case[2]
        assert torch.equal(alone[-n:], together[row:row + n]), (i, case)
        row += n


def test_metadata_layout():
    meta = AttentionMetadata.build([[7, 3, 9], [4], [12, 13]], [9, 2, 5], [1, 2, 5], 4, torch.device("cpu"),
                                   TorchAttention())
    assert meta.slot_mapping.tolist() == [9 * 4 + 0, 4 * 4 + 0, 4 * 4 + 1, 48, 49, 50, 51, 52]
    assert meta.query_start_loc.tolist() == [0, 1, 3, 8]
    assert meta.context_lens.tolist() == [9, 2, 5]
    assert meta.block_tables.tolist() == [[7, 3, 9], [4, 0, 0], [12, 13, 0]]
    assert (meta.max_query_len, meta.max_context_len) == (5, 9)
    assert meta.decode_seqs.tolist() == [0] and meta.decode_rows.tolist() == [0]
    assert meta.prefill.rows.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert (meta.prefill.starts, meta.prefill.lens) == ([1, 3], [2, 5])
    assert meta.prefill.key_slots == [None, None] and meta.prefill.masks == [None, None]  # fresh: plain causal
    # A later chunk: 2 new tokens at positions 4, 5 read their 6 keys from the cache, under their own mask.
    chunk = AttentionMetadata.build([[7, 3]], [6], [2], 4, torch.device("cpu"), TorchAttention()).prefill
    assert chunk.key_slots[0].tolist() == [28, 29, 30, 31, 12, 13]
    assert chunk.masks[0].tolist() == [[[[True] * 5 + [False], [True] * 6]]]


def test_decode_kernel_calls_per_layer_do_not_grow_with_the_batch(kernel, monkeypatch):
    calls = {"sdpa": 0, "decode": 0}
    sdpa = F.scaled_dot_product_attention

    def counting_sdpa(*args, **kwargs):
        calls["sdpa"] += 1
        return sdpa(*args, **kwargs)

    backend = CpuPagedAttention(kernel)
    decode = backend.decode

    def counting_decode(*args, **kwargs):
        calls["decode"] += 1
        return decode(*args, **kwargs)

    monkeypatch.setattr(sdpa_backend.F, "scaled_dot_product_attention", counting_sdpa)
    monkeypatch.setattr(backend, "decode", counting_decode)
    for num_seqs in (1, 16, 64):
        for kinds in (["decode"], ["prompt", "chunk", "decode"]):
            calls.update(sdpa=0, decode=0)
            # One block each, so that 64 fit in the pool: (context, new tokens) per kind.
            shapes = {"decode": (5, 1), "prompt": (3, 3), "chunk": (6, 2)}
            cases = [([b], *shapes[kinds[b % len(kinds)]]) for b in range(num_seqs)]
            run(backend, cases, 8, 4, 2)
            # Decodes: one kernel call for all. Prompts: one SDPA call each, on its own rows (no padding);
            # its cost grows with its tokens squared, so the call itself is noise.
            prompts = sum(1 for case in cases if case[2] > 1)
            assert calls["decode"] <= 1 and calls["sdpa"] == prompts, (num_seqs, kinds, calls)


def test_without_a_compiler_the_worker_falls_back_to_pytorch(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("VLLM_V0_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="no C compiler"):
        build.build(cpu_attention.SOURCE)
    assert cpu_attention.load() is None
    assert "attention: C kernel unavailable, using the PyTorch path" in caplog.text


def test_a_kernel_build_is_cached_by_source_and_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_V0_CACHE", str(tmp_path))
    # The smallest kernel: the cache's rules are the same for all, and the attention kernel takes half a minute.
    source = pathlib.Path(build.__file__).parent / "argmax.c"
    first = build.build(source)
    mtime = first.stat().st_mtime_ns
    assert build.build(source) == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    assert first.parent == tmp_path / "kernels"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_triton_kernel_on_the_gpu_matches_the_reference(group, dtype):
    rng = random.Random(f"cuda-{group}")
    cases = random_step(rng, 16, True, 12, MIXES["everything"])
    out, expected, *_ = run(TritonPagedAttention(), cases, 16, 2 * group, 2, dtype, device="cuda")
    tolerance = 1e-5 if dtype == torch.float32 else 2 ** -8 * 4 + 1e-3
    assert (out.double() - expected).abs().max().item() <= tolerance


def _transposed_layout(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dims stored transposed, as CUDA's memory-efficient SDPA returns."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def test_non_contiguous_attention_outputs_change_nothing(tmp_path, monkeypatch):
    from services.model_worker.config.engine import EngineConfig
    from services.model_worker.engine.llm_engine import LLMEngine
    from services.model_worker.model import qwen3
    from services.model_worker.config.sampling import SamplingParams
    from tests.checkpoints import make_checkpoint

    make_checkpoint(tmp_path, num_attention_heads=8, num_key_value_heads=2)  # grouped heads, as in every Qwen3
    engine = LLMEngine(tmp_path, EngineConfig(device="cpu", dtype="float32", num_blocks=64, block_size=8))
    engine.runner.attention = TorchAttention()  # decodes and prefills through SDPA
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3], [8]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = engine.generate(prompts, params)

    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(sdpa_backend.F, "scaled_dot_product_attention",
                        lambda *a, **k: _transposed_layout(sdpa(*a, **k)))
    layer_attention = qwen3.paged_attention
    monkeypatch.setattr(qwen3, "paged_attention", lambda *a, **k: _transposed_layout(layer_attention(*a, **k)))
    assert not _transposed_layout(torch.zeros(2, 3, 4)).is_contiguous()
    assert engine.generate(prompts, params) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_kernel_equals_index_copy(kernel, dtype):
    """Keys and values cut from a fused projection (tokens strided) land where index_copy_ puts them."""
    gen = torch.Generator().manual_seed(5)
    tokens, kv_heads, slots = 7, 2, 64
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * HEAD_DIM, generator=gen).to(dtype)
    _, k, v = qkv.split([4 * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM], dim=-1)
    k, v = k.view(tokens, kv_heads, HEAD_DIM), v.view(tokens, kv_heads, HEAD_DIM)
    slot_mapping = torch.tensor([63, 0, 17, 18, 40, 5, 33])
    caches = [torch.randn(kv_heads, slots, HEAD_DIM, generator=gen).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    TorchAttention().write_kv(k, v, *expected, slot_mapping)
    assert cpu_attention.can_write_kv(k, v, *caches, slot_mapping)
    CpuPagedAttention(kernel).write_kv(k, v, *caches, slot_mapping)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])

    before = [c.clone() for c in caches]
    with pytest.raises(IndexError):
        cpu_attention.write_kv(kernel, k, v, *caches, torch.tensor([1, 2, 3, 4, 5, 6, slots]))
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])  # nothing written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_kernel_at_checkpoint_head_sizes(kernel, dtype, head_dim, group, block_size):
    """The kernel at the head sizes of real checkpoints (the tests above use small heads): its
    vector loops and tails, the group sizes it unrolls and one it does not (5), the head sizes it
    unrolls (64, 128, 256) and one it does not (96), and contexts that end mid-chunk and mid-block.
    Within one bf16 rounding of the float64 attention of its inputs."""
    gen = torch.Generator().manual_seed(head_dim * 100 + group * 10 + block_size)
    rng = random.Random(f"{head_dim}-{group}-{block_size}")
    kv_heads, contexts = 2, [1, 2, 3, 5, 31, 64, 65, 130, 301, 512, 600]
    tables, free = [], list(range(sum(-(-c // block_size) for c in contexts) + 4))
    rng.shuffle(free)
    for c in contexts:
        tables.append([free.pop() for _ in range(-(-c // block_size))])
    num_slots = (len(free) + sum(map(len, tables))) * block_size
    k_cache = torch.randn(kv_heads, num_slots, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, num_slots, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(contexts), kv_heads * group, head_dim, generator=gen).to(dtype)
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    scale = head_dim ** -0.5
    out = cpu_attention.paged_decode_attention(kernel, q, k_cache, v_cache, torch.tensor(contexts, dtype=torch.int32),
                                               block_tables, block_size, scale)
    for b, (c, table) in enumerate(zip(contexts, tables)):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(c)])
        keys = k_cache[:, slots].double().repeat_interleave(group, 0)      # (H, c, D)
        values = v_cache[:, slots].double().repeat_interleave(group, 0)
        weights = (torch.einsum("hd,hcd->hc", q[b].double(), keys) * scale).softmax(-1)
        expected = torch.einsum("hc,hcd->hd", weights, values)
        tolerance = 1e-5 if dtype == torch.float32 else 2 ** -8 * 4 + 1e-3  # |out| < 4: one bf16 rounding
        assert (out[b].double() - expected).abs().max().item() <= tolerance, (b, c)
