"""The gateway's scoring core: (query, document) pairs through Qwen3-Reranker's prompt, scored by the workers.

Each pair's score is sigmoid(logit("yes") - logit("no")) at its prompt's last position, as the published
Qwen3-Reranker usage computes it (the softmax of the two logits, taken at "yes").
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from gateway.core.prompt_runs import (
    PoolingRecord,
    check_ids,
    check_inputs,
    check_text,
    encode_texts,
    input_token_limit,
    run_on_workers,
)
from gateway.core.request_id import check_request_id, new_request_id
from gateway.core.validation import RequestLimits
from rpcserver.errors import InvalidArgument, Unavailable
from vllm_v0.worker.v1 import worker_pb2

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
SYSTEM_PROMPT = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                 'Note that the answer can only be "yes" or "no".')
ANSWERS = ("yes", "no")


def reranker_prompt(query: str, document: str, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """Qwen3-Reranker's prompt for one pair, as its published usage writes it: a system turn, the pair in the
    user turn, and the assistant turn opened after an empty think block. Every pair of one query shares all
    of it up to the document, which the workers' prefix cache computes once."""
    return (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
            f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")


@dataclass
class ScoringRequest:
    """Pairs to score, independent of how they arrived (a query and its documents, or vLLM's text_1/text_2)."""

    pairs: list[tuple[str, str]]  # (query, document)
    instruction: str | None = None  # None: DEFAULT_INSTRUCTION
    adapter: str = ""
    request_id: str = ""  # the caller's; checked, never sent to the worker
    # The caller's names for the two sides of a pair, so that an error names the field sent.
    query_name: str = "query"
    documents_name: str = "documents"


@dataclass
class Scores:
    scores: list[float]  # one per pair, in order, in [0, 1]
    prompt_tokens: int  # tokens of every pair's prompt


class ScoringCore:
    """Scores any number of requests concurrently; each pair is one prompt on a worker."""

    def __init__(self, downstreams, limits_overrides: dict,
                 check_adapter: Callable[[str], None] = lambda adapter: None):
        self.downstreams = downstreams  # Downstreams, or any object with the same surface
        self.limits_overrides = limits_overrides
        self.check_adapter = check_adapter  # refuses a LoRA adapter no worker serves ("": the base model)
        self.request_limits = RequestLimits.from_overrides(limits_overrides)
        self._answer_ids: list[int] | None = None  # the ids of "yes" and "no", once encoded

    def check(self, req: ScoringRequest) -> None:
        """Refuses a request invalid on its face, before anything waits on the tokenizer or a worker."""
        check_request_id(req.request_id)
        check_inputs(len(req.pairs), req.documents_name)
        one_query = len({query for query, _ in req.pairs}) == 1
        for i, (query, document) in enumerate(req.pairs):
            name = req.query_name if one_query else f"{req.query_name}[{i}]"
            if not query:
                raise InvalidArgument(f"{name} is empty; give the query to score against")
            check_text(query, name, self.request_limits)
            check_text(document, f"{req.documents_name}[{i}]", self.request_limits)
        if req.instruction is not None:
            check_text(req.instruction, "instruction", self.request_limits)

    async def score(self, req: ScoringRequest, record: PoolingRecord,
                    timeout: Callable[[], float | None] = lambda: None) -> Scores:
        """Each pair's relevance, counted in `record`; `timeout()` gives the seconds left (None: no deadline)."""
        record.inputs = len(req.pairs)
        self.check(req)
        info = self.downstreams.worker_info
        max_tokens = input_token_limit(info, self.limits_overrides)
        self.check_adapter(req.adapter)
        answers = await self.answer_ids(timeout())
        instruction = DEFAULT_INSTRUCTION if req.instruction is None else req.instruction
        texts = [reranker_prompt(query, document, instruction) for query, document in req.pairs]
        prompts = await encode_texts(self.downstreams.tokenizer, texts, False, timeout())
        for i, ids in enumerate(prompts):
            check_ids(ids, f"{req.documents_name}[{i}] (in the reranker's prompt)", max_tokens, info.vocab_size)
        record.prompt_tokens = sum(len(ids) for ids in prompts)
        worker_id = new_request_id()

        def call(positions: range) -> worker_pb2.ScoreRequest:
            return worker_pb2.ScoreRequest(request_id=f"{worker_id}-{positions.start}", adapter=req.adapter,
                                           token_ids=answers,
                                           inputs=[worker_pb2.TokenIds(token_ids=prompts[i]) for i in positions])

        replies = await run_on_workers(self.downstreams, "Score", prompts, 4 * len(answers) + 16, call, timeout(),
                                       req.adapter)
        results = [result for reply in replies for result in reply.results]
        if len(results) != len(prompts) or any(len(r.logits) != len(answers) for r in results):
            raise Unavailable(f"the model workers sent {len(results)} results for {len(prompts)} inputs, or not "
                              f"{len(answers)} logits each")
        return Scores([relevance(r.logits[0], r.logits[1]) for r in results], record.prompt_tokens)

    async def answer_ids(self, timeout: float | None) -> list[int]:
        """The ids of "yes" and "no" in the served vocabulary: encoded once, then kept."""
        if self._answer_ids is None:
            encoded = await encode_texts(self.downstreams.tokenizer, ANSWERS, False, timeout)
            if any(len(ids) != 1 for ids in encoded):
                spelled = ", ".join(f"{a!r} -> {list(ids)}" for a, ids in zip(ANSWERS, encoded))
                raise InvalidArgument(f"this checkpoint's tokenizer does not encode \"yes\" and \"no\" as one token "
                                      f"each ({spelled}): it is not a Qwen3-Reranker-style checkpoint")
            self._answer_ids = [ids[0] for ids in encoded]
        return self._answer_ids


def relevance(yes_logit: float, no_logit: float) -> float:
    """sigmoid(yes - no), without overflow at either end."""
    margin = yes_logit - no_logit
    if margin >= 0:
        return 1.0 / (1.0 + math.exp(-margin))
    odds = math.exp(margin)
    return odds / (1.0 + odds)

