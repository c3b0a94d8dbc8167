"""A sequence created with output ids already generated goes on exactly as the unbroken run did: run a request
whole to N tokens, then to k tokens, then from the prompt with those k as output ids, and the continuation must
be tokens k..N of the whole run (float32, tiny random checkpoint)."""
from __future__ import annotations

import itertools

import pytest
import torch

from rpcserver.errors import InvalidArgument
from services.model_worker.config.engine import EngineConfig, SchedulerLimits, SpeculativeConfig
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine, StepOutput
from tests.checkpoints import make_checkpoint

N = 24
EOS = 7
PROMPT = [11, 230, 41, 97, 5, 300, 12, 64, 151]
# Prompt lookup needs repeats to propose anything.
REPEATING = [21, 22, 23, 24, 25, 21, 22, 23, 24, 25, 21, 22]
_ids = itertools.count()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-resume")
    model = make_checkpoint(path, eos_token_id=(EOS,))
    # A draft model for speculation: the same weights, perturbed, so it agrees with the target often but not always.
    torch.manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.15 * param.std())
    draft = tmp_path_factory.mktemp("tiny-resume-draft")
    model.save_pretrained(draft)
    return path, draft


def make_engine(checkpoint, prefix_caching: bool = False, spec: str | None = None, async_scheduling=None,
                max_model_len: int | None = None) -> LLMEngine:
    path, draft = checkpoint
    speculative = SpeculativeConfig(spec, num_speculative_tokens=3, ngram_min=1, ngram_max=3, disable_batch_size=64,
                                    draft_model=str(draft) if spec == "draft" else None) if spec else None
    return LLMEngine(path, EngineConfig(device="cpu", dtype="float32", num_blocks=128, block_size=4,
                                        enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling,
                                        max_model_len=max_model_len, limits=SchedulerLimits(8, 256),
                                        speculative=speculative))


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams, output_ids=(), seed=None) -> list[StepOutput]:
    """The request's outputs, stepped to its end."""
    request_id = f"r{next(_ids)}"
    engine.add_request(request_id, prompt, params, list(output_ids), seed)
    outputs = []
    while not outputs or outputs[-1].finish_reason is None:
        outputs += [out for out in engine.step() if out.request_id == request_id]
    return outputs


def tokens(outputs: list[StepOutput]) -> list[int]:
    return [out.token_id for out in outputs]


def with_max(params: SamplingParams, max_tokens: int) -> SamplingParams:
    return SamplingParams(**{**params.__dict__, "max_tokens": max_tokens})


def check_resumes(engine: LLMEngine, prompt: list[int], params: SamplingParams, ks=(1, 6, N - 1)) -> list[StepOutput]:
    """Whole run, then for each k: a run cut at k tokens, then one resumed after them; returns the whole run."""
    whole = run(engine, prompt, params)
    assert len(whole) == N and whole[-1].finish_reason.value == "length"
    for k in ks:
        head = tokens(run(engine, prompt, with_max(params, k)))
        assert head == tokens(whole)[:k]  # the cut run is the same request, stopped early
        rest = run(engine, prompt, params, head)
        assert tokens(rest) == tokens(whole)[k:], f"k={k}"
        assert rest[0].prompt_tokens == len(prompt) and rest[-1].finish_reason.value == "length"
    return whole


def greedy(**extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, **extra)


def seeded(seed: int = 1234, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=60, top_p=0.95, seed=seed, max_tokens=N, ignore_eos=True, **extra)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_goes_on_exactly(checkpoint, async_scheduling):
    check_resumes(make_engine(checkpoint, async_scheduling=async_scheduling), PROMPT, greedy())


def test_a_seeded_request_draws_at_the_count_it_would_have(checkpoint):
    engine = make_engine(checkpoint)
    whole = check_resumes(engine, PROMPT, seeded())
    # The draws matter: another seed gives other tokens, so the test would see a counter restarted at 0.
    assert tokens(run(engine, PROMPT, seeded(seed=99))) != tokens(whole)


def test_an_unseeded_request_given_a_seed_draws_as_a_seeded_one(checkpoint):
    engine = make_engine(checkpoint)
    want = tokens(run(engine, PROMPT, seeded(seed=4321)))
    unseeded = seeded(seed=None)
    assert tokens(run(engine, PROMPT, unseeded, seed=4321)) == want
    assert tokens(run(engine, PROMPT, unseeded, want[:5], seed=4321)) == want[5:]


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.3), dict(presence_penalty=0.9, frequency_penalty=0.7),
                                       dict(presence_penalty=0.5, repetition_penalty=1.2)])
@pytest.mark.parametrize("sampled", [False, True])
def test_penalties_count_the_given_ids_as_output(checkpoint, penalties, sampled):
    engine = make_engine(checkpoint)
    params = seeded(**penalties) if sampled else greedy(**penalties)
    whole = check_resumes(engine, REPEATING, params)
    assert tokens(whole) != tokens(run(engine, REPEATING, seeded() if sampled else greedy()))  # they bite


@pytest.mark.parametrize("params", [greedy(logprobs=3), seeded(logprobs=2)], ids=["greedy", "seeded"])
def test_logprobs_go_on(checkpoint, params):
    engine = make_engine(checkpoint)
    whole = check_resumes(engine, PROMPT, params, ks=(5,))
    rest = run(engine, PROMPT, params, tokens(whole)[:5])
    for got, want in zip(rest, whole[5:]):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top_logprobs] == [t for t, _ in want.top_logprobs]
        assert [lp for _, lp in got.top_logprobs] == pytest.approx([lp for _, lp in want.top_logprobs], abs=1e-4)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_carries_on(checkpoint, method):
    plain = tokens(run(make_engine(checkpoint), REPEATING, greedy()))
    engine = make_engine(checkpoint, spec=method)
    whole = check_resumes(engine, REPEATING, greedy(), ks=(4,))
    assert tokens(whole) == plain
    proposed = engine.speculator.num_proposed
    rest = run(engine, REPEATING, greedy(), plain[:4])
    assert tokens(rest) == plain[4:]
    assert engine.speculator.num_proposed > proposed  # the resumed sequence itself was proposed for


def test_the_prefix_cache_serves_the_recomputed_prompt_and_outputs(checkpoint):
    engine = make_engine(checkpoint, prefix_caching=True)
    whole = tokens(run(engine, PROMPT, greedy()))
    hits, k = engine.block_manager.prefix_hits, 15
    assert tokens(run(engine, PROMPT, greedy(), whole[:k])) == whole[k:]
    # Every full block of prompt + outputs but the one holding the last token came from the cache.
    block = engine.kv_cache.block_size
    assert engine.block_manager.prefix_hits - hits == (len(PROMPT) + k - 1) // block * block


def test_max_tokens_counts_the_given_ids(checkpoint):
    engine = make_engine(checkpoint)
    whole = tokens(run(engine, PROMPT, greedy()))
    rest = run(engine, PROMPT, greedy(), whole[:N - 3])
    assert len(rest) == 3 and rest[-1].finish_reason.value == "length"


def test_a_stop_id_after_the_given_ids_still_ends_the_request(checkpoint):
    engine = make_engine(checkpoint)
    whole = tokens(run(engine, PROMPT, greedy()))
    stop = whole[10]
    assert stop not in whole[:10]
    params = greedy(stop_token_ids=(stop,))
    rest = run(engine, PROMPT, params, whole[:4])
    assert tokens(rest) == whole[4:11] and rest[-1].finish_reason.value == "eos"


# -- refusals ------------------------------------------------------------------------------------------------


def refusal(engine: LLMEngine, params: SamplingParams, output_ids, prompt=PROMPT) -> str:
    with pytest.raises(InvalidArgument) as refused:
        engine.add_request(f"bad{next(_ids)}", prompt, params, output_ids)
    assert not engine.has_work()
    return str(refused.value)


def test_refusals_name_what_is_wrong(checkpoint):
    engine = make_engine(checkpoint, max_model_len=40)
    vocab = engine.config.vocab_size
    assert "outside the vocabulary" in refusal(engine, greedy(), [3, vocab])
    assert "outside the vocabulary" in refusal(engine, greedy(), [-1])
    assert "reaches max_tokens (24)" in refusal(engine, greedy(), [3] * N)
    unbounded = SamplingParams(temperature=0.0, ignore_eos=True)
    message = refusal(engine, unbounded, [3] * (40 - len(PROMPT)))
    assert "context of 40 tokens" in message and "nothing is left to generate" in message
    assert "output_token_ids[2] = 7 is a stop id" in refusal(engine, SamplingParams(temperature=0.0, max_tokens=N),
                                                             [3, 4, EOS])
    assert "output_token_ids[1] = 9 is a stop id" in refusal(engine, greedy(stop_token_ids=(9,)), [3, 9, 4])
    assert "prompt_logprobs" in refusal(engine, greedy(prompt_logprobs=1), [3])
    # Each at its edge is accepted: an eos under ignore_eos, one id short of max_tokens, the last room in the context.
    assert len(run(engine, PROMPT, greedy(), [3, EOS])) == N - 2
    assert len(run(engine, PROMPT, greedy(), [3] * (N - 1))) == 1
    assert len(run(engine, PROMPT, unbounded, [3] * (40 - len(PROMPT) - 1))) == 1
