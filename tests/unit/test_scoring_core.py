"""The scoring core over fake downstreams: Qwen3-Reranker's published prompt, its tokens, sigmoid(yes - no), and
the refusals."""
from __future__ import annotations

import asyncio
import math

import pytest

from gateway.core.prompt_runs import MAX_INPUTS, PoolingRecord
from gateway.core.scoring import ScoringCore, ScoringRequest, relevance, reranker_prompt
from rpcserver.errors import InvalidArgument
from tests.unit.pooling_fakes import fake_downstreams, fake_logit

# Qwen3-Reranker's model card, as published: the prompt's three parts, tokenized one by one and joined.
PUBLISHED_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
                    "the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n"
                    "<|im_start|>user\n")
PUBLISHED_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
PUBLISHED_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def published_pair(query: str, document: str, instruction: str = PUBLISHED_INSTRUCTION) -> str:
    return "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}".format(
        instruction=instruction, query=query, doc=document)


def score(downstreams, req: ScoringRequest, core: ScoringCore | None = None):
    core = core or ScoringCore(downstreams, {})
    record = PoolingRecord("score", "r1")
    return asyncio.run(core.score(req, record)), record


DOCUMENTS = ["The capital of China is Beijing.", "Gravity is a force  ", "", "a\n\nb?!\n", " 日本語 🎉 ",
             "<|im_end|> inside"]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_each_pair_is_the_published_prompt_tokenized_as_published(demo_tokenizer, document):
    query = "What is the capital of China? "
    text = reranker_prompt(query, document)
    assert text == PUBLISHED_PREFIX + published_pair(query, document) + PUBLISHED_SUFFIX
    # The model card tokenizes prefix, pair and suffix apart and joins the ids; one pass over the whole text
    # gives the same ids, as each part starts or ends at a special token or a newline.
    published = (demo_tokenizer.encode(PUBLISHED_PREFIX) + demo_tokenizer.encode(published_pair(query, document))
                 + demo_tokenizer.encode(PUBLISHED_SUFFIX))
    assert demo_tokenizer.encode(text) == published


def test_scores_are_sigmoid_of_yes_minus_no_for_the_pairs_in_order(demo_tokenizer):
    downstreams = fake_downstreams(demo_tokenizer, max_context=256)
    documents = ["Beijing is the capital.", "Gravity pulls.", "Beijing is the capital."]
    result, record = score(downstreams, ScoringRequest([("capital of China?", d) for d in documents],
                                                       instruction="Find facts", adapter="rerank-lora"))
    yes, no = demo_tokenizer.encode("yes"), demo_tokenizer.encode("no")
    assert len(yes) == len(no) == 1
    work = downstreams.fleet.workers["w1"].stub.requests[0]
    assert list(work.token_ids) == yes + no and work.adapter == "rerank-lora"
    prompts = [demo_tokenizer.encode(reranker_prompt("capital of China?", d, "Find facts")) for d in documents]
    assert [list(i.token_ids) for i in work.inputs] == prompts
    want = [1 / (1 + math.exp(-(fake_logit(p, yes[0]) - fake_logit(p, no[0])))) for p in prompts]
    assert result.scores == pytest.approx(want, abs=1e-7)
    assert result.prompt_tokens == record.prompt_tokens == sum(map(len, prompts)) and record.inputs == 3
    # Text encoded without added special tokens, as the model card does; the repeated document once.
    texts = [r.text for r in downstreams.tokenizer.requests]
    assert texts.count(reranker_prompt("capital of China?", documents[0], "Find facts")) == 1
    assert not any(r.add_special_tokens for r in downstreams.tokenizer.requests)


def test_the_answer_ids_are_encoded_once_per_core(demo_tokenizer):
    downstreams = fake_downstreams(demo_tokenizer, max_context=256)
    core = ScoringCore(downstreams, {})
    for _ in range(2):
        score(downstreams, ScoringRequest([("q", "d")]), core)
    texts = [r.text for r in downstreams.tokenizer.requests]
    assert texts.count("yes") == texts.count("no") == 1


def test_an_answer_of_several_tokens_is_a_clear_error(demo_tokenizer):
    downstreams = fake_downstreams(demo_tokenizer, max_context=256)

    class SplitYes:
        """A vocabulary where "yes" is two tokens."""
        def encode(self, text, add_special_tokens=False):
            return [1, 2] if text == "yes" else demo_tokenizer.encode(text, add_special_tokens)

    downstreams.tokenizer.core = SplitYes()
    with pytest.raises(InvalidArgument, match="does not encode \"yes\" and \"no\" as one token each"):
        score(downstreams, ScoringRequest([("q", "d")]))


def test_relevance_is_the_sigmoid_and_never_overflows():
    assert relevance(2.0, -1.0) == pytest.approx(1 / (1 + math.exp(-3.0)))
    assert relevance(-1000.0, 1000.0) == 0.0 and relevance(1000.0, -1000.0) == 1.0
    assert relevance(3.5, 3.5) == 0.5


@pytest.mark.parametrize("req, says", [
    (ScoringRequest([]), "documents is empty"),
    (ScoringRequest([("", "d")]), "query is empty"),
    (ScoringRequest([("q1", "d"), ("", "e")], query_name="text_1"), "text_1[1] is empty"),
    (ScoringRequest([("q", "d")] * (MAX_INPUTS + 1)), f"at most {MAX_INPUTS}"),
    (ScoringRequest([("q", "word " * 200)]), "documents[0] (in the reranker's prompt) is"),
    (ScoringRequest([("q", "d")], request_id="x" * 129), "request_id is 129 characters"),
])
def test_refusals_name_what_is_wrong_and_reach_no_worker(demo_tokenizer, req, says):
    downstreams = fake_downstreams(demo_tokenizer, max_context=128)
    with pytest.raises(InvalidArgument) as refused:
        score(downstreams, req)
    assert says in str(refused.value)
    assert downstreams.fleet.workers["w1"].stub.requests == []
