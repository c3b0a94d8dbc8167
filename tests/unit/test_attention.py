"""Paged attention against plain causal attention over each sequence's keys, for every way the cache is read."""
import pytest
import torch

from services.model_worker.attention import AttentionMetadata, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 4
NUM_BLOCKS = 64


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int) -> torch.Tensor:
    """q: (Lq, H, D) at positions first_pos..; keys, values: (L, Hkv, D) at positions 0..L-1."""
    group = HEADS // KV_HEADS
    keys, values = keys.repeat_interleave(group, 1).double(), values.repeat_interleave(group, 1).double()
    out = []
    for i in range(q.shape[0]):
        visible = first_pos + i + 1
        scores = torch.einsum("hd,lhd->hl", q[i].double(), keys[:visible]) * HEAD_DIM ** -0.5
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values[:visible]))
    return torch.stack(out).float()


# (block table, context length after the step, new tokens this step); no two share a block.
CASES = {
    "prompt": ([24, 25, 26], 11, 11),
    "one_token_prompt": ([9], 1, 1),
    "decode_ascending_run": ([3, 4, 5], 11, 1),
    "decode_descending_run": ([12, 11, 10], 10, 1),   # the last block's unfilled slots sit mid-stretch
    "decode_run_ending_high": ([21, 20, 22], 10, 1),  # any order, last block at the stretch's end
    "decode_scattered": ([30, 7, 41], 9, 1),
    "decode_block_boundary": ([50, 51, 52], 9, 1),
    "one_token_chunk_of_a_longer_prompt": ([33, 34, 35], 5, 1),       # blocks past the context
    "one_token_chunk_descending": ([47, 46, 45], 5, 1),
    "later_chunk": ([40, 42, 44], 12, 5),
    "later_chunk_contiguous": ([60, 61, 62], 10, 3),
}


def run_batch(cases: list[tuple[list[int], int, int]], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK, HEAD_DIM, generator=gen)  # stale data everywhere
    v_cache = torch.randn(KV_HEADS, NUM_BLOCKS * BLOCK, HEAD_DIM, generator=gen)
    seqs = []
    for table, kv_len, q_len in cases:
        keys = torch.randn(kv_len, KV_HEADS, HEAD_DIM, generator=gen)
        values = torch.randn(kv_len, KV_HEADS, HEAD_DIM, generator=gen)
        q = torch.randn(q_len, HEADS, HEAD_DIM, generator=gen)
        for pos in range(kv_len - q_len):  # what earlier steps wrote
            slot = table[pos // BLOCK] * BLOCK + pos % BLOCK
            k_cache[:, slot], v_cache[:, slot] = keys[pos], values[pos]
        seqs.append((q, keys, values))
    meta = AttentionMetadata.build([c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases], BLOCK,
                                   torch.device("cpu"))
    q = torch.cat([s[0] for s in seqs])
    new_k = torch.cat([k[c[1] - c[2]:] for (_, k, _), c in zip(seqs, cases)])
    new_v = torch.cat([v[c[1] - c[2]:] for (_, _, v), c in zip(seqs, cases)])
    out = paged_attention(q, new_k, new_v, k_cache, v_cache, meta, HEAD_DIM ** -0.5)
    expected = torch.cat([reference(q_, k, v, c[1] - c[2]) for (q_, k, v), c in zip(seqs, cases)])
    return out, expected, k_cache, v_cache, seqs


@pytest.mark.parametrize("case", list(CASES))
def test_each_layout_matches_plain_attention(case):
    out, expected, *_ = run_batch([CASES[case]])
    assert out.shape == expected.shape
    assert (out - expected).abs().max().item() <= 1e-5


def test_mixed_batch_matches_plain_attention():
    out, expected, *_ = run_batch(list(CASES.values()))
    assert (out - expected).abs().max().item() <= 1e-5


def test_new_tokens_are_written_to_their_slots():
    table, kv_len, q_len = CASES["later_chunk"]
    _, _, k_cache, v_cache, [(_, keys, values)] = run_batch([(table, kv_len, q_len)])
    for pos in range(kv_len):
        slot = table[pos // BLOCK] * BLOCK + pos % BLOCK
        assert torch.equal(k_cache[:, slot], keys[pos]) and torch.equal(v_cache[:, slot], values[pos])


def test_contiguous_blocks_are_read_in_place():
    meta = AttentionMetadata.build([[3, 4, 5], [12, 11, 10], [30, 7, 41]], [11, 10, 9], [1, 1, 1], BLOCK,
                                   torch.device("cpu"))
    ascending, descending, scattered = meta.plans
    assert ascending.keys == slice(12, 23) and ascending.mask is None
    assert descending.keys == slice(40, 52) and descending.mask is not None
    assert isinstance(scattered.keys, torch.Tensor)
