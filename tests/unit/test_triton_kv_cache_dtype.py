"""8-bit KV caches in the Triton kernels: the write against torch's arithmetic, attention against float64.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets it where there is no GPU);
on a machine with CUDA the same tests run the compiled kernels on the GPU.
"""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from services.model_worker.kernels import triton_attention, triton_kv_write

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
# bfloat16 queries: the weights (times the value scales) and the output are each rounded once to bf16,
# within 2^-7 of their size (the interpreter truncates; a GPU rounds to nearest, within 2^-8).
BF16_RELATIVE = 2 * 2 ** -7
KINDS = ["fp8", "int8"]


@pytest.fixture(autouse=True)
def triton_is_installed():
    # A test dependency (requirements-dev.txt): its absence is a failure, not a skip.
    assert triton_attention.available() and triton_kv_write.available(), "triton is part of the test dependencies"


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of x (..., D): int8 values and their float32 scales (...,); a row of zeros has scale 0."""
    x = x.float()
    s = x.abs().amax(-1) / 127
    q = torch.where(s[..., None] == 0, 0.0, torch.round(x / s[..., None]))
    return q.to(torch.int8), s


def e4m3_grid() -> torch.Tensor:
    """Every finite e4m3 value, every midpoint between neighbours (ties) and a float32 step either side
    of each, values below half the smallest subnormal, past 448, infinities and NaNs, of both signs."""
    finite = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    positive = finite[finite.isfinite() & (finite >= 0)].unique()
    mid = (positive[1:] + positive[:-1]) / 2
    up, down = torch.nextafter(mid, torch.tensor(1e9)), torch.nextafter(mid, torch.tensor(0.0))
    extremes = torch.tensor([2.0 ** -11, 2.0 ** -10, 449.0, 464.0, 1e6, float("inf"), float("nan")])
    values = torch.cat([positive, mid, up, down, extremes])
    return torch.cat([values, -values])


def run_write(k, v, kind, slots, num_slots, k_scale=0.5, v_scale=0.0137):
    """write_kv into fresh caches (filled with a marker), and the caches and scales it left."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    dtype = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}.get(kind, k.dtype)
    marker = torch.full((num_kv_heads, num_slots, head_dim), 3.0).to(dtype)
    k_cache, v_cache = marker.clone().to(DEVICE), marker.clone().to(DEVICE)
    if kind == "fp8":
        scales = torch.tensor([k_scale]), torch.tensor([v_scale])
    elif kind == "int8":
        scales = torch.full((num_kv_heads, num_slots), -1.0), torch.full((num_kv_heads, num_slots), -1.0)
    else:
        scales = None, None
    scales = [s if s is None else s.to(DEVICE) for s in scales]
    triton_kv_write.write_kv(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slots.to(DEVICE), *scales)
    return k_cache.cpu(), v_cache.cpu(), [s if s is None else s.cpu() for s in scales], marker


def written(cache, slots):
    """The cache's rows at slots, as (T, Hkv, D)."""
    return cache[:, slots].transpose(0, 1)


def untouched(cache, slots, marker):
    others = torch.ones(cache.shape[1], dtype=torch.bool)
    others[slots] = False
    return cache[:, others].view(torch.uint8).equal(marker[:, others].view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_write_matches_torch_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(7, 3, 24, generator=gen) * torch.logspace(-3, 2, 7)[:, None, None]
    v = torch.randn(7, 3, 24, generator=gen)
    k[1, 0] = 0.0  # a row of zeros: scale 0, values 0
    k[2, 1, :5] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5])  # scale 1: halves round to even
    k, v = k.to(dtype), v.to(dtype)
    slots = torch.randperm(40, generator=gen)[:7]
    k_cache, v_cache, (k_scale, v_scale), marker = run_write(k, v, "int8", slots, 40)
    for cache, scale, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        expected, expected_scale = quantize_int8(x)
        assert torch.equal(written(cache, slots), expected)
        assert torch.equal(scale[:, slots].T, expected_scale)
        assert untouched(cache, slots, marker)
        assert (scale[:, [s for s in range(40) if s not in slots.tolist()]] == -1.0).all()
    assert torch.equal(written(k_cache, slots)[2, 1, :5], torch.tensor([127, 2, -4, 0, 0], dtype=torch.int8))
    assert k_scale[0, slots[1]] == 0.0 and k_scale[1, slots[2]] == 1.0


def test_fp8_write_rounds_every_e4m3_boundary_as_torch_does():
    """Values scaled by a power of two (exact): the rounding alone, at every tie and either side of it."""
    grid = e4m3_grid()
    pad = -grid.numel() % 32
    x = torch.cat([grid, torch.zeros(pad)]).view(-1, 2, 16) * 0.5
    slots = torch.arange(x.shape[0]).flip(0)
    k_cache, v_cache, _, _ = run_write(x, -x, "fp8", slots, x.shape[0] + 3, k_scale=0.5, v_scale=0.5)
    assert torch.equal(written(k_cache, slots).view(torch.uint8), quantize_fp8(x, 0.5).view(torch.uint8))
    assert torch.equal(written(v_cache, slots).view(torch.uint8), quantize_fp8(-x, 0.5).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_write_divides_by_the_layer_scale_as_torch_does(dtype):
    gen = torch.Generator().manual_seed(1)
    k = (torch.randn(5, 3, 24, generator=gen) * 4).to(dtype)  # past 448 * 0.0137: some saturate
    v = (torch.randn(5, 3, 24, generator=gen) * 1e-3).to(dtype)  # subnormals at scale 0.5
    slots = torch.tensor([9, 0, 4, 17, 3])
    k_cache, v_cache, _, marker = run_write(k, v, "fp8", slots, 20, k_scale=0.0137, v_scale=0.5)
    assert torch.equal(written(k_cache, slots).view(torch.uint8), quantize_fp8(k, 0.0137).view(torch.uint8))
    assert torch.equal(written(v_cache, slots).view(torch.uint8), quantize_fp8(v, 0.5).view(torch.uint8))
    assert (written(k_cache, slots).float().abs() == 448).any()
    assert untouched(k_cache, slots, marker) and untouched(v_cache, slots, marker)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_cache_in_the_model_dtype_takes_a_copy(dtype):
    """k and v as views of one fused projection (strided rows), as the model hands them over."""
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(6, 8, 16, generator=gen).to(dtype)
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    slots = torch.tensor([11, 2, 7, 0, 5, 8])
    k_cache, v_cache, _, marker = run_write(k, v, "auto", slots, 12)
    assert torch.equal(written(k_cache, slots), k) and torch.equal(written(v_cache, slots), v)
    assert untouched(k_cache, slots, marker)


def make_step(contexts, q_lens, kind, kv_heads, group, block_size, dtype=torch.float32, seed=0, head_dim=16):
    """A step over an 8-bit paged cache with scattered blocks, the float64 reference over the
    dequantized cache, and its magnitude (the softmax-weighted |values|): what a rounded weight can move.
    contexts: tokens per sequence after the step; q_lens: its new tokens."""
    gen = torch.Generator().manual_seed(seed)
    used = [-(-c // block_size) for c in contexts]
    num_blocks = sum(used) + 1
    order = torch.randperm(num_blocks - 1, generator=gen)
    table = torch.full((len(contexts), max(used)), num_blocks - 1, dtype=torch.int32)
    keys = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen)
    values = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen)
    if kind == "fp8":
        k_scale, v_scale = torch.tensor([0.004]), torch.tensor([0.01])  # some keys saturate
        k_cache, v_cache = quantize_fp8(keys, k_scale.item()), quantize_fp8(values, v_scale.item())
        k_deq, v_deq = k_cache.double() * k_scale.item(), v_cache.double() * v_scale.item()
    else:
        (k_cache, k_scale), (v_cache, v_scale) = quantize_int8(keys), quantize_int8(values)
        k_deq, v_deq = k_cache.double() * k_scale[..., None], v_cache.double() * v_scale[..., None]
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    query_start = torch.zeros(len(contexts) + 1, dtype=torch.int32)
    query_start[1:] = torch.tensor(q_lens).cumsum(0)
    expected, magnitude = [], []
    for b, (context, q_len) in enumerate(zip(contexts, q_lens)):
        table[b, :used[b]] = order[sum(used[:b]):sum(used[:b + 1])].int()
        j = torch.arange(context)
        slots = table[b, j // block_size].long() * block_size + j % block_size
        seq_keys, seq_values = (c[:, slots].repeat_interleave(group, 0) for c in (k_deq, v_deq))  # (H, L, D)
        for i in range(q_len):
            visible = context - q_len + i + 1
            scores = torch.einsum("hd,hld->hl", q[int(query_start[b]) + i].double(), seq_keys[:, :visible])
            weights = (scores * head_dim ** -0.5).softmax(-1)
            expected.append(torch.einsum("hl,hld->hd", weights, seq_values[:, :visible]))
            magnitude.append(torch.einsum("hl,hld->hd", weights, seq_values[:, :visible].abs()))
    inputs = (q, k_cache, v_cache, query_start, torch.tensor(contexts, dtype=torch.int32), table)
    return inputs, (k_scale, v_scale), torch.stack(expected), torch.stack(magnitude)


def attend(inputs, scales, block_size, partitions=None):
    q, k_cache, v_cache, query_start, context_lens, table = (t.to(DEVICE) for t in inputs)
    out = triton_attention.paged_attention(q, k_cache, v_cache, query_start, context_lens, table, block_size,
                                           int(query_start.diff().max()), q.shape[-1] ** -0.5,
                                           *(s.to(DEVICE) for s in scales), partitions=partitions)
    assert out.dtype == q.dtype
    return out.double().cpu()


def error(out, expected):
    return (out - expected).abs().max().item()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_rows_over_an_8bit_cache_match_float64(kind, group, block_size):
    contexts = [1, 17, 70, block_size, 45]
    inputs, scales, expected, _ = make_step(contexts, [1] * len(contexts), kind, kv_heads=2 if group == 1 else 1,
                                         group=group, block_size=block_size)
    assert error(attend(inputs, scales, block_size), expected) <= 1e-5


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_rows_after_cached_prefixes_match_float64(kind, dtype):
    """A chunk after cached blocks, a fresh prompt and a decode in one step; GQA of 2."""
    inputs, scales, expected, magnitude = make_step([40, 9, 23], [7, 9, 1], kind, kv_heads=2, group=2,
                                                    block_size=16, dtype=dtype, seed=3)
    tolerance = 1e-5 if dtype == torch.float32 else BF16_RELATIVE * magnitude + 1e-6
    assert ((attend(inputs, scales, 16) - expected).abs() <= tolerance).all()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("group", [1, 4])
def test_the_split_decode_over_an_8bit_cache_matches_float64(kind, group):
    """Partitions of keys and their combination (flash-decoding): one long context, one past a partition, one short."""
    inputs, scales, expected, _ = make_step([600, 300, 5], [1, 1, 1], kind, kv_heads=2 if group == 1 else 1,
                                         group=group, block_size=16, seed=4)
    split, single = attend(inputs, scales, 16, partitions=3), attend(inputs, scales, 16, partitions=1)
    assert error(split, expected) <= 1e-5 and error(single, expected) <= 1e-5


def test_the_scales_change_the_result():
    """Keys and values both read their scales: doubling either moves the output."""
    inputs, (k_scale, v_scale), expected, _ = make_step([30, 12], [1, 1], "int8", kv_heads=1, group=2, block_size=8)
    assert error(attend(inputs, (k_scale, v_scale), 8), expected) <= 1e-5
    assert error(attend(inputs, (k_scale * 2, v_scale), 8), expected) > 1e-2
    assert error(attend(inputs, (k_scale, v_scale * 2), 8), expected) > 1e-2


@pytest.mark.parametrize("kind", KINDS)
def test_an_8bit_cache_without_scales_is_refused(kind):
    inputs, *_ = make_step([5], [1], kind, kv_heads=1, group=1, block_size=8)
    q, k_cache, v_cache, query_start, context_lens, table = inputs
    with pytest.raises(ValueError, match="k_scale"):
        triton_attention.paged_attention(q, k_cache, v_cache, query_start, context_lens, table, 8, 1, 0.25)
    with pytest.raises(ValueError, match="scales"):
        triton_kv_write.write_kv(q[:, :1], q[:, :1], k_cache, v_cache, torch.zeros(1, dtype=torch.int64))


def compile_all() -> list[str]:
    """The 8-bit variants of the kernels, compiled for an H100/H200 (sm_90); the write kernel's PTX divisions."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def build(fn, pointer_types: dict, constants: dict):
        signature = {name: "constexpr" if name in constants
                     else "*" + pointer_types.get(name, pointer_types["*"]) if name.endswith("_ptr")
                     else "fp32" if name == "scale" else "i32" for name in fn.arg_names}
        source = ASTSource(fn=fn, signature=signature,
                           constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
        return triton.compile(source, target=GPUTarget("cuda", 90, 32))

    lines = []
    for cache in ("u8", "i8"):
        caches = {"k_cache_ptr": cache, "v_cache_ptr": cache, "k_scale_ptr": "fp32", "v_scale_ptr": "fp32"}
        for split in (False, True):
            integers = dict.fromkeys(("query_start_ptr", "context_lens_ptr", "block_tables_ptr"), "i32")
            scratch = dict.fromkeys(("part_out_ptr", "lse_ptr"), "fp32" if split else "bf16")
            build(triton_attention._paged_attention_kernel, {"*": "bf16", **integers, **scratch, **caches},
                  dict(GROUP=2, HEAD_DIM=128, BLOCK_D=128, PAGE=16, BLOCK_M=triton_attention.BLOCK_M,
                       BLOCK_N=triton_attention.BLOCK_N, IEEE=False, UPCAST=False, SPLIT=split,
                       MIN_PARTITION=triton_attention.MIN_PARTITION))
            lines.append(f"attention {cache} split={split}")
        compiled = build(triton_kv_write._write_kv_kernel, {"*": "bf16", "slot_mapping_ptr": "i64", **caches},
                         dict(HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128))
        divisions = sorted(set(re.findall(r"\bdiv\.[a-z0-9.]+", compiled.asm["ptx"])))
        lines.append(f"write {cache} {' '.join(divisions)}")
    return lines


def test_the_8bit_kernels_compile_for_sm90(tmp_path):
    """The interpreter accepts what the compiler may refuse; Triton's wheel carries ptxas, so the whole
    compile runs here, in a subprocess (the interpreter, once chosen, is for the process)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    # IEEE-rounded divisions (div.rn), as torch divides: the GPU writes torch's bytes too.
    assert result.stdout.splitlines() == ["attention u8 split=False", "attention u8 split=True", "write u8 div.rn.f32",
                                          "attention i8 split=False", "attention i8 split=True", "write i8 div.rn.f32"]


if __name__ == "__main__":
    print("\n".join(compile_all()))
