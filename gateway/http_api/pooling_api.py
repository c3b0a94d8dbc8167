"""The embedding and scoring routes: OpenAI's /v1/embeddings, /v1/rerank (also /rerank, /v2/rerank) and vLLM's
/v1/score (also /score), thin adapters over the embedding and scoring cores."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gateway.core.embedding import EmbeddingCore
from gateway.core.prompt_runs import PoolingRecord
from gateway.core.request_id import check_request_id, new_request_id
from gateway.core.scoring import ScoringCore
from gateway.http_api.disconnect import until_disconnect
from gateway.http_api.openai_errors import error_response, grpc_code
from gateway.http_api.openai_protocol import parse_body, refuse_unknown_fields
from gateway.http_api.pooling_protocol import (
    EmbeddingsBody,
    RerankBody,
    ScoreBody,
    embedding_request,
    embeddings_body,
    rerank_body,
    rerank_request,
    score_body,
    score_request,
    with_param,
)


def add_pooling_routes(app: FastAPI, embedding: EmbeddingCore, scoring: ScoringCore,
                       read_body: Callable[[Request], Awaitable[bytes]], check_model: Callable[[str], Any],
                       model_name: Callable[[], str], new_deadline: Callable[[], Any]) -> None:
    """`read_body`: the body, once the API key is checked; `check_model`: a body's `model` -> the LoRA adapter it
    names ("" or None: the served model), an unknown one refused; `new_deadline()`: the request's deadline from
    now (the gateway's --http-request-timeout), with remaining() and exceeded()."""

    async def run(request: Request, kind: str, body_type, work) -> JSONResponse:
        """Parse, check the model and the request id, run `work(body, adapter, request_id, record, deadline)` for
        the response body; every failure an OpenAI error object naming the field it concerns; one log line."""
        deadline = new_deadline()
        record = PoolingRecord(kind, new_request_id())
        error = None
        try:
            body = await parse_body(body_type, await read_body(request))
            refuse_unknown_fields(body)
            adapter = check_model(body.model) or ""
            request_id = request.headers.get("x-request-id", "")
            check_request_id(request_id)  # the gRPC request_id's rule
            record.request_id = request_id = request_id or record.request_id
            replies = []

            async def call() -> None:
                replies.append(await work(body, adapter, request_id, record, deadline))

            if not await until_disconnect(request, call()):
                # Nobody is left to read the body; the cancel has dropped the inputs from the workers.
                error = asyncio.CancelledError("the client disconnected")
                return Response(status_code=499)
            reply = replies[0]
        except Exception as e:  # noqa: BLE001 - a plain error response
            error = e
            if grpc_code(e) == grpc.StatusCode.DEADLINE_EXCEEDED and deadline.seconds:
                error = deadline.exceeded()
            return error_response(with_param(error))
        except BaseException as e:  # a cancel: logged as one
            error = e
            raise
        finally:
            record.done(grpc_code(error), error)
        # A few thousand embeddings are millions of numbers: the body is rendered on a thread.
        return await asyncio.to_thread(JSONResponse, reply, headers={"x-request-id": request_id})

    async def embed(body: EmbeddingsBody, adapter: str, request_id: str, record: PoolingRecord, deadline) -> dict:
        req = embedding_request(body, adapter, request_id)
        result = await embedding.embed(req, record, timeout=deadline.remaining)
        return await asyncio.to_thread(embeddings_body, result, body.encoding_format, adapter or model_name())

    async def rerank(body: RerankBody, adapter: str, request_id: str, record: PoolingRecord, deadline) -> dict:
        result = await scoring.score(rerank_request(body, adapter, request_id), record, deadline.remaining)
        return rerank_body(body, result, adapter or model_name(), request_id)

    async def score(body: ScoreBody, adapter: str, request_id: str, record: PoolingRecord, deadline) -> dict:
        result = await scoring.score(score_request(body, adapter, request_id), record, deadline.remaining)
        return score_body(result, adapter or model_name(), request_id)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await run(request, "embed", EmbeddingsBody, embed)

    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    @app.post("/rerank")
    async def rerank_route(request: Request):
        return await run(request, "score", RerankBody, rerank)

    @app.post("/v1/score")
    @app.post("/score")
    async def score_route(request: Request):
        return await run(request, "score", ScoreBody, score)
