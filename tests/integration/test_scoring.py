"""Scoring prompts and logit_bias through the real `openai` client and gRPC, against transformers' float32 Qwen3."""
from __future__ import annotations

import openai
import pytest
import torch

from vllm_v0.gateway.v1 import gateway_pb2

PROMPT = "The capital of France is Paris, and the capital of Japan is"
TOLERANCE = 1e-4


@pytest.fixture()
def client(stack):
    with openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(reference):
    return reference[1]


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


def assert_scored(model, ids: list[int], token_logprobs: list[float | None]) -> None:
    expected = reference_logprobs(model, ids)
    assert token_logprobs[0] is None
    got = torch.tensor(token_logprobs[1:len(ids)], dtype=torch.float64)
    want = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].double()
    assert (got - want).abs().max().item() <= TOLERANCE


def test_echo_max_tokens_0_scores_the_prompt(client, reference_model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    reply = client.completions.create(model="", prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    choice = reply.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == len(ids)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) and "".join(logprobs.tokens) == PROMPT
    assert_scored(reference_model, ids, logprobs.token_logprobs)
    assert logprobs.top_logprobs[0] is None
    expected = reference_logprobs(reference_model, ids)
    for position in range(1, len(ids)):
        values, top_ids = expected[position - 1].topk(2)
        top = logprobs.top_logprobs[position]
        assert list(top) == [tokenizer.decode([t]) for t in top_ids.tolist()]
        assert max(abs(a - b) for a, b in zip(top.values(), values.tolist())) <= TOLERANCE
    offsets = logprobs.text_offset
    assert offsets == [len("".join(logprobs.tokens[:i])) for i in range(len(ids))]


def test_echo_with_a_generated_token_twice_over_a_warm_prefix_cache(client, reference_model, tokenizer):
    # lm-evaluation-harness's request: token ids, echo, logprobs 1, one generated token. The second
    # run finds the prompt in the prefix cache, which must not cost it its logprobs.
    ids = tokenizer.encode(PROMPT)
    greedy = int(reference_logprobs(reference_model, ids)[-1].argmax())
    for _ in range(2):
        reply = client.completions.create(model="", prompt=ids, echo=True, logprobs=1, max_tokens=1,
                                          temperature=0)
        logprobs = reply.choices[0].logprobs
        assert len(logprobs.token_logprobs) == len(ids) + 1
        assert_scored(reference_model, [*ids, greedy], logprobs.token_logprobs)
        assert reply.choices[0].text == PROMPT + tokenizer.decode([greedy])


def test_batched_token_id_prompts_are_indexed_as_openai_does(client, gateway, tokenizer):
    prompts = [tokenizer.encode("Hello there"), tokenizer.encode("One two three four")]
    reply = client.completions.create(model="", prompt=prompts, n=2, max_tokens=5, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for p, ids in enumerate(prompts):
        messages = list(gateway.Generate(gateway_pb2.GenerateRequest(
            prompt=tokenizer.decode(ids), max_tokens=5, temperature=0)))
        want = "".join(m.text for m in messages)
        assert reply.choices[2 * p].text == reply.choices[2 * p + 1].text == want
    assert reply.usage.prompt_tokens == sum(len(ids) for ids in prompts)
    assert reply.usage.completion_tokens == 4 * 5 or reply.choices[0].finish_reason == "stop"


def test_batched_string_prompts_stream(client):
    strings = ["Hello there", "One two three four", "x"]
    chunks = list(client.completions.create(model="", prompt=strings, max_tokens=4, temperature=0, stream=True,
                                            echo=True))
    texts = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts) == [0, 1, 2]
    for index, prompt in enumerate(strings):
        assert texts[index].startswith(prompt) and len(texts[index]) > len(prompt)


def test_logit_bias_forces_and_bans(client, gateway, reference_model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    forced = 9707  # any id of the vocabulary
    reply = client.completions.create(model="", prompt=PROMPT, max_tokens=3, temperature=0,
                                      logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert reply.choices[0].text == tokenizer.decode([forced] * 3)
    chat = client.chat.completions.create(model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          temperature=0, logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == tokenizer.decode([forced] * 2)
    # -100 on the greedy token: the next best, from the reference's own logits, is chosen instead.
    best, second = reference_logprobs(reference_model, ids)[-1].topk(2).indices.tolist()
    messages = list(gateway.Generate(gateway_pb2.GenerateRequest(prompt=PROMPT, max_tokens=1, temperature=0,
                                                                 logit_bias={best: -100.0})))
    assert messages[0].token_ids == [second]
    # Sampled at temperature 1, a banned token never comes.
    for seed in range(5):
        messages = list(gateway.Generate(gateway_pb2.GenerateRequest(
            prompt=PROMPT, max_tokens=8, temperature=1.0, seed=seed, logit_bias={best: -100.0, second: -100.0},
            ignore_eos=True)))
        assert not {best, second} & {t for m in messages for t in m.token_ids}


def test_grpc_prompt_logprobs(gateway, reference_model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    messages = list(gateway.Generate(gateway_pb2.GenerateRequest(prompt=PROMPT, max_tokens=2, temperature=0,
                                                                 prompt_logprobs=1)))
    scored = messages[0].prompt_logprobs
    assert [s.token_id for s in scored] == ids
    assert not scored[0].HasField("logprob") and not scored[0].top
    assert_scored(reference_model, ids, [s.logprob if s.HasField("logprob") else None for s in scored])
    assert all(len(s.top) == 1 for s in scored[1:])
    assert all(not m.prompt_logprobs for m in messages[1:])


def test_grpc_max_tokens_0_scores_without_generating(gateway, reference_model, tokenizer):
    ids = tokenizer.encode(PROMPT)
    (message,) = gateway.Generate(gateway_pb2.GenerateRequest(prompt=PROMPT, max_tokens=0, prompt_logprobs=0))
    assert message.finish_reason == gateway_pb2.FINISH_REASON_LENGTH and not message.token_ids
    assert (message.usage.prompt_tokens, message.usage.completion_tokens) == (len(ids), 0)
    assert_scored(reference_model, ids, [s.logprob if s.HasField("logprob") else None
                                         for s in message.prompt_logprobs])


@pytest.mark.parametrize("fields, says", [
    (dict(logit_bias={200000: 1.0}), "logit_bias key 200000"),
    (dict(logit_bias={5: 150.0}), "must be in [-100, 100]"),
    (dict(prompt_logprobs=21), "prompt_logprobs must be in [0, 20]"),
    (dict(max_tokens=0), "max_tokens must be >= 1"),
])
def test_grpc_refuses_bad_values(gateway, fields, says):
    import grpc

    with pytest.raises(grpc.RpcError) as error:
        list(gateway.Generate(gateway_pb2.GenerateRequest(prompt=PROMPT, **fields)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in error.value.details()


def test_http_refuses_max_tokens_0_without_echo(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="", prompt=PROMPT, max_tokens=0)
    assert error.value.body["param"] == "max_tokens"
