"""The Triton kernel's split over keys (flash-decoding) against a float64 reference, in Triton's interpreter."""
import os

import pytest
import torch

from services.model_worker.kernels import triton_attention

pytestmark = pytest.mark.skipif(not triton_attention.available(), reason="triton is not installed")
# The GPU compiles the kernel for CUDA tensors: there the cuda-marked test covers it.
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="runs the kernel in Triton's interpreter, on CPU tensors")

HEAD_DIM = 16
BLOCK_SIZE = 16
BF16_TOLERANCE = 2 ** -8 * 4 + 1e-3  # outputs are averages of N(0, 1) values: |x| < 4, one bf16 rounding


def make_step(contexts, q_lens, kv_heads, group, dtype=torch.float32, width=None, num_blocks=None, seed=0,
              head_dim=HEAD_DIM):
    """A step's tensors over a paged cache with every block scattered, and the float64 reference output.

    contexts: tokens per sequence after the step; q_lens: its new tokens (the last ones of its
    context). width: the block tables' width (default: the longest context's blocks); num_blocks:
    the cache's (default: just enough).
    """
    gen = torch.Generator().manual_seed(seed)
    used = [-(-c // BLOCK_SIZE) for c in contexts]
    width = width or max(used)
    num_blocks = num_blocks or sum(used) + 1
    order = torch.randperm(num_blocks - 1, generator=gen)[:sum(used)]
    table = torch.full((len(contexts), width), num_blocks - 1, dtype=torch.int32)  # padding: a block no one uses
    k_cache = torch.randn(kv_heads, num_blocks * BLOCK_SIZE, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks * BLOCK_SIZE, head_dim, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    query_start = torch.zeros(len(contexts) + 1, dtype=torch.int32)
    query_start[1:] = torch.tensor(q_lens).cumsum(0)
    expected = []
    for b, (context, q_len) in enumerate(zip(contexts, q_lens)):
        table[b, :used[b]] = order[sum(used[:b]):sum(used[:b + 1])].int()
        j = torch.arange(context)
        slots = table[b, j // BLOCK_SIZE].long() * BLOCK_SIZE + j % BLOCK_SIZE
        keys = k_cache[:, slots].double().repeat_interleave(group, 0)     # (H, L, D)
        values = v_cache[:, slots].double().repeat_interleave(group, 0)
        for i in range(q_len):
            visible = context - q_len + i + 1
            row = q[int(query_start[b]) + i].double()
            scores = torch.einsum("hd,hld->hl", row, keys[:, :visible]) * head_dim ** -0.5
            expected.append(torch.einsum("hl,hld->hd", scores.softmax(-1), values[:, :visible]))
    inputs = (q, k_cache, v_cache, query_start, torch.tensor(contexts, dtype=torch.int32), table)
    return inputs, torch.stack(expected)


def attend(inputs, partitions=None):
    q, k_cache, v_cache, query_start, context_lens, table = inputs
    max_query_len = int(query_start.diff().max())
    return triton_attention.paged_attention(q, k_cache, v_cache, query_start, context_lens, table, BLOCK_SIZE,
                                            max_query_len, q.shape[-1] ** -0.5, partitions=partitions)


def error(out, expected):
    return (out.double().cpu() - expected).abs().max().item()


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 4])
def test_one_long_context_split_matches_the_reference(group, dtype):
    inputs, expected = make_step([2100], [1], kv_heads=2 if group == 1 else 1, group=group, dtype=dtype)
    split, single = attend(inputs, partitions=8), attend(inputs, partitions=1)
    tolerance = 1e-5 if dtype == torch.float32 else BF16_TOLERANCE
    assert error(split, expected) <= tolerance and error(single, expected) <= tolerance
    assert error(split, single.double()) <= tolerance


@interpreted
@pytest.mark.parametrize("group", [1, 4])
def test_mixed_contexts_split_matches_the_reference(group):
    """Short and long contexts together: ends mid-block and mid-partition, one token, one shorter than a partition."""
    contexts = [1, 17, 300, 777, 2049, 40]
    inputs, expected = make_step(contexts, [1] * len(contexts), kv_heads=2 if group == 1 else 1, group=group)
    split = attend(inputs, partitions=5)
    assert error(split, expected) <= 1e-5
    assert error(split, attend(inputs, partitions=1).double()) <= 1e-5


@interpreted
def test_partitions_past_every_context_change_no_bit():
    """Contexts shorter than a partition: the rest are empty (lse -inf), and the result is the single pass's."""
    inputs, expected = make_step([1, 2, 3, 250], [1] * 4, kv_heads=1, group=2)
    split = attend(inputs, partitions=4)
    assert torch.equal(split, attend(inputs, partitions=1))
    assert error(split, expected) <= 1e-5


@interpreted
def test_a_row_with_no_key_is_zero_not_nan():
    """Every partition of an empty context is empty: the combination divides by nothing, as the single pass does."""
    inputs, _ = make_step([1, 600], [1, 1], kv_heads=1, group=2)
    inputs[4][0] = 0  # the first sequence sees no key
    split, single = attend(inputs, partitions=3), attend(inputs, partitions=1)
    assert torch.equal(split[0], torch.zeros_like(split[0])) and torch.equal(single[0], split[0])


@interpreted
def test_a_mixed_step_splits_its_prompt_rows_too():
    """Prompt chunks after cached keys (causal rows) and decodes in one split launch."""
    inputs, expected = make_step([900, 600, 3], [1, 6, 1], kv_heads=1, group=4)
    assert error(attend(inputs, partitions=3), expected) <= 1e-5


class RecordedGrids:
    """The paged kernel, recording the grid of every launch."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@interpreted
def test_the_split_depends_on_shapes_alone_as_a_replayed_graph_needs(monkeypatch):
    """Tensors of a graph bucket (table as wide as the longest allowed context) take new contexts in place:
    the default choice splits, keeps the same grid, and stays exact for each."""
    recorded = RecordedGrids(triton_attention._paged_attention_kernel)
    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", recorded)
    inputs, expected = make_step([2100, 5], [1, 1], kv_heads=1, group=2, width=160, num_blocks=200, seed=1)
    assert error(attend(inputs), expected) <= 1e-5
    other, other_expected = make_step([40, 1500], [1, 1], kv_heads=1, group=2, width=160, num_blocks=200, seed=2)
    for buffer, source in zip(inputs, other):  # what a replay does: copy into the captured tensors
        buffer.copy_(source)
    assert error(attend(inputs), other_expected) <= 1e-5
    # 2 programs of 1 KV head on the interpreter's 4 stand-in multiprocessors: 4 partitions each.
    assert recorded.grids == [(2, 1, 4), (2, 1, 4)]


@pytest.mark.parametrize("programs, max_keys, expected", [
    (8, 16384, 33),       # one sequence of Qwen3-0.6B (8 KV heads), long context: 33 x 8 = 264 = 2 per SM
    (8, 1024, 4),         # a shorter one: partitions of no less than MIN_PARTITION keys
    (8, 256, 1),          # too short to split
    (128, 40960, 3),      # 16 sequences
    (512, 40960, 1),      # 64 sequences fill the GPU alone
    (1, 1 << 20, 128),    # one KV head, a huge table: capped
])
def test_the_number_of_partitions_fills_the_multiprocessors(monkeypatch, programs, max_keys, expected):
    monkeypatch.setattr(triton_attention, "multiprocessors", lambda device: 132)  # an H200
    assert triton_attention.num_partitions(programs, max_keys, torch.device("cuda")) == expected


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_split_on_the_gpu_matches_the_reference(dtype):
    """Compiled for the GPU, at Qwen3's head size: the device's own choice, the single pass and a forced split."""
    contexts = [1, 17, 300, 777, 16384, 2049, 40]
    inputs, expected = make_step(contexts, [1] * len(contexts), kv_heads=8, group=2, dtype=dtype, head_dim=128)
    inputs = tuple(t.cuda() for t in inputs)
    tolerance = 1e-5 if dtype == torch.float32 else BF16_TOLERANCE
    for partitions in (None, 1, 7):
        assert error(attend(inputs, partitions), expected) <= tolerance, partitions
