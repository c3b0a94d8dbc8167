"""Prompt logprobs from the engine's prefill against transformers' log-softmax on a float32 checkpoint."""
import pytest
import torch

from services.model_worker.config.engine import EngineConfig, SchedulerLimits
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import LLMEngine
from tests.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompt_logprobs")
    reference = make_checkpoint(path)
    # A 16-token step budget prefills the 40-token prompts in chunks.
    engine = LLMEngine(path, EngineConfig(device="cpu", dtype="float32", num_blocks=96, block_size=8,
                                          limits=SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=16)))
    return reference, engine


def reference_logprobs(reference, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)


def run(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams):
    engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_work():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def check(reference, prompt, scored, top_n):
    expected = reference_logprobs(reference, prompt)
    assert len(scored) == len(prompt) and scored[0] is None
    for position in range(1, len(prompt)):
        logprob, top = scored[position]
        row = expected[position - 1]
        assert abs(logprob - row[prompt[position]].item()) <= 1e-4
        assert len(top) == top_n
        values, ids = row.topk(top_n)
        assert [t for t, _ in top] == ids.tolist()
        assert max(abs(v - e) for (_, v), e in zip(top, values.tolist())) <= 1e-4 if top_n else True


def test_chunked_prefill_scores_every_prompt_token(pair):
    reference, engine = pair
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    outputs = run(engine, "a", prompt, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=3))
    assert len(outputs) == 3
    check(reference, prompt, outputs[0].prompt_logprobs, 3)
    assert all(o.prompt_logprobs is None for o in outputs[1:])  # sent once, then dropped


def test_a_cached_prefix_is_computed_again_when_scored(pair):
    reference, engine = pair
    prompt = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    run(engine, "warm", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    hits = engine.block_manager.prefix_hits
    outputs = run(engine, "b", prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    assert engine.block_manager.prefix_hits == hits  # no block reused
    check(reference, prompt, outputs[0].prompt_logprobs, 0)
    # A request that does not ask still reuses the cache.
    run(engine, "c", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    assert engine.block_manager.prefix_hits > hits


def test_batched_with_plain_requests(pair):
    reference, engine = pair
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 21, 1)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"m{i}", prompt, SamplingParams(temperature=0.0, max_tokens=2,
                                                          prompt_logprobs=None if i == 1 else 1))
    firsts = {}
    while engine.has_work():
        for out in engine.step():
            firsts.setdefault(out.request_id, out)
    check(reference, prompts[0], firsts["m0"].prompt_logprobs, 1)
    assert firsts["m1"].prompt_logprobs is None
    assert firsts["m2"].prompt_logprobs == [None]
