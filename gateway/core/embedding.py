"""The gateway's embedding core: inputs checked, texts prompted and encoded, embedded by the workers.

Plain Python over the downstreams object; the gRPC servicer and the HTTP front both adapt it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
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

# The Sentence Transformers modules whose work the workers do: the transformer itself, last-token pooling, and
# the L2 normalisation every embedding gets anyway.
SERVED_MODULES = ("Transformer", "Pooling", "Normalize")
SERVED_POOLING = ["lasttoken"]
# An embedding of an unknown size is taken to be this long when sizing worker calls (a worker that does not
# report its hidden size).
ASSUMED_HIDDEN_SIZE = 8192


@dataclass
class EmbeddingRequest:
    """One embedding request, independent of how it arrived."""

    inputs: list[str | Sequence[int]]  # texts, or token ids taken as they are
    dimensions: int | None = None  # keep this many leading dimensions, then normalise again
    prompt_name: str = ""  # a Sentence Transformers prompt of the checkpoint; "": its default, if any
    adapter: str = ""
    request_id: str = ""  # the caller's; checked, never sent to the worker
    inputs_name: str = "inputs"  # the caller's name for `inputs`, so that an error names the field sent


@dataclass
class Embeddings:
    vectors: list[Sequence[float]]  # one per input, in order, each of unit length
    prompt_tokens: int  # tokens of all inputs, prompts included


class EmbeddingCore:
    """Embeds any number of requests concurrently; each input is one prompt on a worker."""

    def __init__(self, downstreams, limits_overrides: dict,
                 check_adapter: Callable[[str], None] = lambda adapter: None):
        self.downstreams = downstreams  # Downstreams, or any object with the same surface
        self.limits_overrides = limits_overrides
        self.check_adapter = check_adapter  # refuses a LoRA adapter no worker serves ("": the base model)
        self.request_limits = RequestLimits.from_overrides(limits_overrides)

    def check(self, req: EmbeddingRequest) -> None:
        """Refuses a request invalid on its face, before anything waits on the tokenizer or a worker."""
        check_request_id(req.request_id)
        check_inputs(len(req.inputs), req.inputs_name)
        for i, item in enumerate(req.inputs):
            name = f"{req.inputs_name}[{i}]"
            if not len(item):
                raise InvalidArgument(f"{name} is empty; give some text or at least one token id")
            if isinstance(item, str):
                check_text(item, name, self.request_limits)
        if req.dimensions is not None and req.dimensions < 1:
            raise InvalidArgument(f"dimensions must be at least 1, got {req.dimensions}")

    async def embed(self, req: EmbeddingRequest, record: PoolingRecord,
                    timeout: Callable[[], float | None] = lambda: None, max_reply_bytes: int | None = None
                    ) -> Embeddings:
        """The embeddings of the request's inputs, counted in `record`. `timeout()` gives the seconds left
        (None: no deadline); `max_reply_bytes`: refuse a request whose embeddings would not fit one message of
        that size."""
        record.inputs = len(req.inputs)
        self.check(req)
        prompt = self.prompt(req.prompt_name)
        info = self.downstreams.worker_info
        max_tokens = input_token_limit(info, self.limits_overrides)
        self.check_adapter(req.adapter)
        size = self._dimensions(req.dimensions, info.hidden_size)
        if max_reply_bytes is not None and size is not None and len(req.inputs) * (4 * size + 16) > max_reply_bytes:
            raise InvalidArgument(f"the embeddings of {len(req.inputs)} inputs of {size} dimensions would take "
                                  f"about {len(req.inputs) * 4 * size} bytes, more than one reply may "
                                  f"({max_reply_bytes}, --max-message-bytes): send fewer inputs a request, or ask "
                                  "for fewer dimensions")
        prompts = await self._encode(req, prompt, timeout())
        for i, ids in enumerate(prompts):
            check_ids(ids, f"{req.inputs_name}[{i}]", max_tokens, info.vocab_size)
        record.prompt_tokens = sum(len(ids) for ids in prompts)
        worker_id = new_request_id()

        def call(positions: range) -> worker_pb2.EmbedRequest:
            work = worker_pb2.EmbedRequest(request_id=f"{worker_id}-{positions.start}", adapter=req.adapter,
                                           inputs=[worker_pb2.TokenIds(token_ids=prompts[i]) for i in positions])
            if req.dimensions is not None:
                work.dimensions = req.dimensions
            return work

        replies = await run_on_workers(self.downstreams, "Embed", prompts, 4 * (size or ASSUMED_HIDDEN_SIZE) + 16,
                                       call, timeout(), req.adapter)
        vectors = [e.values for reply in replies for e in reply.embeddings]
        if len(vectors) != len(prompts):
            raise Unavailable(f"the model workers sent {len(vectors)} embeddings for {len(prompts)} inputs")
        return Embeddings(vectors, record.prompt_tokens)

    def prompt(self, name: str) -> str:
        """The text put before each text input: the named Sentence Transformers prompt, else the checkpoint's
        default one, else none. Refuses a checkpoint whose pipeline does more than the workers do."""
        info = self.downstreams.tokenizer_info
        if info is None:
            raise Unavailable("the tokenizer service has not answered yet; retry shortly")
        check_pipeline(list(info.embedding_modules), list(info.embedding_pooling_modes))
        name = name or info.default_embedding_prompt_name
        if not name:
            return ""
        if name not in info.embedding_prompts:
            known = ", ".join(sorted(info.embedding_prompts)) or "none"
            raise InvalidArgument(f"prompt_name {name!r} is not a prompt of this checkpoint (its "
                                  f"config_sentence_transformers.json has: {known})")
        return info.embedding_prompts[name]

    async def _encode(self, req: EmbeddingRequest, prompt: str, timeout: float | None) -> list[Sequence[int]]:
        """Each input's ids: a text with the prompt before it, encoded as Sentence Transformers does (with the
        tokenizer's special tokens: Qwen3-Embedding's ends each input with <|endoftext|>); ids as given."""
        texts = [i for i, item in enumerate(req.inputs) if isinstance(item, str)]
        encoded = await encode_texts(self.downstreams.tokenizer, [prompt + req.inputs[i] for i in texts],
                                     True, timeout) if texts else []
        prompts = list(req.inputs)
        for i, ids in zip(texts, encoded):
            prompts[i] = ids
        return prompts

    @staticmethod
    def _dimensions(dimensions: int | None, hidden_size: int) -> int | None:
        """The length of each embedding; None when neither the request nor the worker says."""
        if dimensions is not None and hidden_size and dimensions > hidden_size:
            raise InvalidArgument(f"dimensions must be in [1, {hidden_size}] (the model's hidden size), "
                                  f"got {dimensions}")
        return dimensions or hidden_size or None


def check_pipeline(modules: list[str], pooling_modes: list[str]) -> None:
    """Refuses a Sentence Transformers pipeline that is more than the transformer, last-token pooling and
    normalisation: its embeddings would not be what the checkpoint's authors meant."""
    other = [m for m in modules if m.rsplit(".", 1)[-1] not in SERVED_MODULES]
    if other:
        raise InvalidArgument(f"this checkpoint's Sentence Transformers pipeline (modules.json) has "
                              f"{', '.join(other)}, which the model workers do not run: they serve the "
                              "transformer with last-token pooling and normalisation only")
    if pooling_modes and pooling_modes != SERVED_POOLING:
        raise InvalidArgument(f"this checkpoint pools by {' + '.join(pooling_modes)} (its Pooling module's "
                              "config.json), which the model workers do not do: they pool by the last token "
                              "(lasttoken, as Qwen3-Embedding)")
