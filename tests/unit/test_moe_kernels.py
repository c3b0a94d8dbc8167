"""The grouped expert kernels (torch grouped_mm, the C kernel, the Triton kernel in its interpreter) against
a float64 loop over tokens and choices, on random routings and the edge cases: idle experts and one expert
that every token chose."""
import pytest
import torch

from services.model_worker.kernels import build, cpu_moe, triton_moe
from services.model_worker.model.layers.fused_moe import (CpuExperts, FusedMoE, TorchGroupedExperts,
                                                          reference_experts, route)


def c_kernel(x, w13, w2, weights, ids):
    library = cpu_moe.load()
    assert library is not None, "the C kernel did not build"
    return cpu_moe.moe_experts(library, x, w13, w2, weights, ids)


KERNELS = {
    "torch_grouped": TorchGroupedExperts(),
    "c": c_kernel,
    "c_without_avx512": c_kernel,  # built for another CPU below
    "triton": triton_moe.fused_moe,
}


def routing(kind: str, tokens: int, num_experts: int, top_k: int, seed: int):
    """(weights (T, K) float32, ids (T, K)): distinct experts per token."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    if kind == "every_token_to_one_expert":
        ids[:, 0] = 5
        for row in ids:  # keep each token's choices distinct
            clash = (row[1:] == 5).nonzero()
            row[1 + clash] = 6 if 6 not in row else 7
    elif kind == "most_experts_idle":
        ids = ids[:, :top_k] % 3  # only experts 0..2 can be chosen
        ids[:, 0], ids[:, 1] = 0, 1
        ids = ids[:, :2]
    logits = torch.randn(tokens, ids.shape[1], generator=generator)
    return torch.softmax(logits, dim=-1), ids


@pytest.mark.parametrize("kind", ["random", "every_token_to_one_expert", "most_experts_idle"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_grouped_kernel_matches_float64_loop(kernel, dtype, kind, monkeypatch):
    if kernel == "triton" and not triton_moe.available():
        pytest.skip("triton is not installed")
    if kernel == "c_without_avx512":
        # The same source built for a CPU with AVX2 and no AVX-512 (x86-64-v3): the generic vectors must still add up.
        monkeypatch.setattr(build, "FLAGS", [f if f != "-march=native" else "-march=x86-64-v3" for f in build.FLAGS])
    torch.manual_seed(1)
    # H, I not multiples of the vector width; bf16 rows of 70 values are not 16-byte aligned either.
    num_experts, hidden, intermediate, tokens, top_k = 12, 72 if kind != "random" else 70, 40, 9, 4
    x = torch.randn(tokens, hidden)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, intermediate) / intermediate ** 0.5
    weights, ids = routing(kind, tokens, num_experts, top_k, seed=2)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    want = reference_experts(x, w13, w2, weights, ids)
    got = KERNELS[kernel](x, w13, w2, weights.to(dtype), ids)
    assert got.shape == x.shape and got.dtype == dtype
    # float32: summation order only; bf16: the intermediate roundings of a bf16 model.
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got.double() - want).abs().max().item() <= tolerance * want.abs().max().item()
    if kind == "most_experts_idle":
        assert len(ids.unique()) < num_experts // 2


def test_triton_alignment_puts_each_pair_once_in_tiles_of_one_expert():
    if not triton_moe.available():
        pytest.skip("triton is not installed")
    _, ids = routing("random", 13, 16, 3, seed=3)
    sorted_pairs, block_expert, total = triton_moe.align_by_expert(ids, 16, block_m=4)
    flat = ids.reshape(-1)
    real = sorted_pairs[sorted_pairs < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))
    assert (sorted_pairs[int(total):] == flat.numel()).all()
    for tile, expert in enumerate(block_expert[: int(total) // 4].tolist()):
        pairs = sorted_pairs[tile * 4:(tile + 1) * 4]
        assert (flat[pairs[pairs < flat.numel()]] == expert).all()


def test_router_renormalises_only_when_asked():
    logits = torch.randn(5, 8)
    weights, ids = route(logits, 3, True, torch.float32)
    assert torch.allclose(weights.sum(-1), torch.ones(5))
    raw, raw_ids = route(logits, 3, False, torch.float32)
    assert torch.equal(ids, raw_ids)
    assert torch.allclose(raw, torch.softmax(logits, -1).gather(1, ids))


def test_cpu_weights_get_the_c_kernel_and_long_prefills_the_grouped_matmul():
    moe = FusedMoE(8, 2, 32, 16, True)
    torch.nn.init.normal_(moe.w13)
    torch.nn.init.normal_(moe.w2)
    moe.process_weights_after_loading()
    assert isinstance(moe.kernel, CpuExperts)
    x = torch.randn(CpuExperts.MAX_TOKENS + 1, 32)
    logits = torch.randn(x.shape[0], 8)
    with torch.inference_mode():
        long = moe(x, logits)
        short = torch.cat([moe(x[i:i + 1], logits[i:i + 1]) for i in range(x.shape[0])])
    assert (long - short).abs().max().item() <= 1e-4 * long.abs().max().item()


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_experts_no_token_chose_are_never_read(kernel, monkeypatch):
    """NaN in every idle expert's weights: any read of them (even times a zero weight) would reach the output."""
    if kernel == "triton" and not triton_moe.available():
        pytest.skip("triton is not installed")
    if kernel == "c_without_avx512":
        monkeypatch.setattr(build, "FLAGS", [f if f != "-march=native" else "-march=x86-64-v3" for f in build.FLAGS])
    torch.manual_seed(4)
    x = torch.randn(3, 48)
    w13 = torch.randn(16, 64, 48) / 7
    w2 = torch.randn(16, 48, 32) / 6
    weights, ids = routing("random", 3, 16, 2, seed=5)
    idle = torch.ones(16, dtype=torch.bool)
    idle[ids.unique()] = False
    want = reference_experts(x, w13, w2, weights, ids)
    w13[idle], w2[idle] = float("nan"), float("nan")
    got = KERNELS[kernel](x, w13, w2, weights, ids)
    assert idle.sum() >= 10
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
