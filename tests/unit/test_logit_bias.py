"""logit_bias in the sampler and its range checks: against logits biased by hand."""
import pytest
import torch

from rpcserver.errors import InvalidArgument
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.executor.sampler import Sampler, apply_penalties
from services.model_worker.kernels import cpu_argmax

VOCAB = 64


def run(logits: torch.Tensor, params: list[SamplingParams], seed: int = 0) -> list[int]:
    draws = [(seed + i, 0) for i in range(len(params))]
    return Sampler()(logits, params, None, draws).token_ids


def test_bias_adds_to_listed_tokens_only():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(logit_bias={5: 2.5, 9: -1.0}), SamplingParams(), SamplingParams(logit_bias={0: 7.0})]
    expected = logits.clone()
    expected[0, 5] += 2.5
    expected[0, 9] -= 1.0
    expected[2, 0] += 7.0
    assert torch.equal(apply_penalties(logits, params, None), expected)


def test_greedy_plus_100_picks_the_token_and_minus_100_never_does():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(1)) * 5
    worst = logits.argmin(dim=-1).tolist()
    best = logits.argmax(dim=-1).tolist()
    forced = run(logits, [SamplingParams(temperature=0.0, logit_bias={w: 100.0}) for w in worst])
    assert forced == worst
    banned = run(logits, [SamplingParams(temperature=0.0, logit_bias={b: -100.0}) for b in best])
    second = logits.topk(2, dim=-1).indices[:, 1].tolist()
    assert banned == second  # the argmax of the biased logits, computed independently
    assert all(b != t for b, t in zip(best, banned))


def test_sampled_rows_never_draw_a_banned_token():
    # Two tokens hold nearly all the mass: banning one leaves the other almost certain.
    logits = torch.full((1, VOCAB), -30.0)
    logits[0, 3] = logits[0, 4] = 10.0
    params = [SamplingParams(temperature=1.0, logit_bias={3: -100.0})]
    assert {run(logits, params, seed)[0] for seed in range(50)} == {4}


def test_unbiased_rows_in_a_biased_batch_are_unchanged():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logit_bias={1: 100.0})] * 2
    out = run(logits, params)
    plain = cpu_argmax.argmax(logits).tolist()
    assert out[0] == plain[0] and out[2] == plain[2]
    assert out[1] == out[3] == 1


def test_logprobs_describe_the_raw_model():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0, logit_bias={7: 100.0}, logprobs=0)]
    out = Sampler()(logits, params, None, [None])
    assert out.token_ids == [7]
    assert out.logprobs[0] == pytest.approx(logits.log_softmax(-1)[0, 7].item(), abs=1e-6)


def test_json_pairs_round_trip():
    # The engine-core socket carries the params as JSON: pairs come back as lists.
    params = SamplingParams(logit_bias=[[3, 1.5], [4, -2.0]])
    assert params.logit_bias == ((3, 1.5), (4, -2.0))


@pytest.mark.parametrize("bias, words", [
    ({VOCAB: 1.0}, f"logit_bias key {VOCAB} must be in [0, {VOCAB - 1}]"),
    ({-1: 1.0}, "logit_bias key -1"),
    ({2: 100.5}, "logit_bias[2] must be in [-100, 100], got 100.5"),
    ({2: float("nan")}, "logit_bias[2] must be a finite number"),
])
def test_out_of_range_is_refused(bias, words):
    with pytest.raises(InvalidArgument, match=words.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(logit_bias=bias).validate(VOCAB)
