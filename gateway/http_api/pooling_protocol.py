"""Request bodies of /v1/embeddings (OpenAI's), /v1/rerank (Jina's and Cohere's, as vLLM serves them) and
/v1/score (vLLM's), their translation into the cores' requests, and the response bodies."""
from __future__ import annotations

import base64
import re
import time
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from gateway.core.embedding import EmbeddingRequest, Embeddings
from gateway.core.scoring import ScoringRequest, Scores
from rpcserver.errors import InvalidArgument


class EmbeddingsBody(BaseModel):
    """OpenAI's POST /v1/embeddings, with Sentence Transformers' `prompt_name`."""
    model_config = ConfigDict(extra="allow")

    model: str = ""
    input: str | list[str] | list[int] | list[list[int]]
    dimensions: int | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None  # labels the request for OpenAI's abuse checks: ignored
    prompt_name: str | None = None


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="allow")  # Cohere's older document objects may carry more fields

    text: str


class RerankBody(BaseModel):
    """POST /v1/rerank: a query and its documents, as Jina's and Cohere's APIs and vLLM take them."""
    model_config = ConfigDict(extra="allow")

    model: str = ""
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None  # None or 0: every document
    return_documents: bool = True  # vLLM always returns them; Cohere's clients may ask not to
    instruction: str | None = None  # Qwen3-Reranker's instruction; None: its default


class ScoreBody(BaseModel):
    """vLLM's POST /v1/score: text_1 against text_2, 1:1, 1:N or N:N."""
    model_config = ConfigDict(extra="allow")

    model: str = ""
    text_1: str | list[str]
    text_2: str | list[str]
    instruction: str | None = None


FIELD_NAMES = frozenset(EmbeddingsBody.model_fields) | frozenset(RerankBody.model_fields) | frozenset(
    ScoreBody.model_fields)
_LEADING_PATH = re.compile(r"([A-Za-z_]\w*)(\[\d+\])*")


def with_param(error: Exception) -> Exception:
    """`error`, naming in `param` the body field its message starts with (`input[3]`), as OpenAI's errors do."""
    match = _LEADING_PATH.match(str(error))
    if isinstance(error, InvalidArgument) and getattr(error, "param", None) is None and match \
            and match.group(1) in FIELD_NAMES:
        error.param = match.group(0)
    return error


def embedding_request(body: EmbeddingsBody, adapter: str, request_id: str) -> EmbeddingRequest:
    """One input per string or list of token ids; a flat list of ids is one input, as OpenAI reads it."""
    given = body.input
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        inputs = [given]
    else:
        inputs = list(given)
    return EmbeddingRequest(inputs=inputs, dimensions=body.dimensions, prompt_name=body.prompt_name or "",
                            adapter=adapter, request_id=request_id, inputs_name="input")


def embeddings_body(result: Embeddings, encoding_format: str, model: str) -> dict[str, Any]:
    """OpenAI's response; base64 is each vector's little-endian float32 bytes, as OpenAI's client decodes it."""
    data = []
    for index, vector in enumerate(result.vectors):
        values = np.asarray(vector, dtype="<f4")
        embedding = base64.b64encode(values.tobytes()).decode() if encoding_format == "base64" else values.tolist()
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def rerank_request(body: RerankBody, adapter: str, request_id: str) -> ScoringRequest:
    if body.top_n is not None and body.top_n < 0:
        raise InvalidArgument(f"top_n must be >= 0 (0: every document), got {body.top_n}")
    documents = [d if isinstance(d, str) else d.text for d in body.documents]
    return ScoringRequest(pairs=[(body.query, d) for d in documents], instruction=body.instruction,
                          adapter=adapter, request_id=request_id)


def rerank_body(body: RerankBody, result: Scores, model: str, request_id: str) -> dict[str, Any]:
    """vLLM's response: the documents by relevance, highest first (ties in their order), cut to top_n."""
    order = sorted(range(len(result.scores)), key=lambda i: -result.scores[i])[:body.top_n or None]
    results = []
    for i in order:
        entry: dict[str, Any] = {"index": i}
        if body.return_documents:
            document = body.documents[i]
            entry["document"] = {"text": document if isinstance(document, str) else document.text}
        entry["relevance_score"] = result.scores[i]
        results.append(entry)
    return {"id": f"rerank-{request_id}", "model": model, "usage": {"total_tokens": result.prompt_tokens},
            "results": results}


def score_request(body: ScoreBody, adapter: str, request_id: str) -> ScoringRequest:
    """vLLM's pairing: one text_1 against every text_2 (1:N), or the i-th of each (N:N)."""
    queries = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    documents = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not queries:
        raise InvalidArgument("text_1 is an empty list; give at least one text")
    if not documents:
        raise InvalidArgument("text_2 is an empty list; give at least one text")
    if len(queries) > 1 and len(queries) != len(documents):
        raise InvalidArgument(f"text_1 holds {len(queries)} texts and text_2 {len(documents)}: pair them 1:1, 1:N "
                              "or N:N")
    pairs = list(zip(queries, documents)) if len(queries) > 1 else [(queries[0], d) for d in documents]
    return ScoringRequest(pairs=pairs, instruction=body.instruction, adapter=adapter, request_id=request_id,
                          query_name="text_1", documents_name="text_2")


def score_body(result: Scores, model: str, request_id: str) -> dict[str, Any]:
    return {"id": f"score-{request_id}", "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(result.scores)],
            "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens,
                      "completion_tokens": 0}}
