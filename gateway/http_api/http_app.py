"""The OpenAI-compatible HTTP API: FastAPI routes, thin adapters over the generation core."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gateway.core.deltas import Delta
from gateway.core.embedding import EmbeddingCore
from gateway.core.generation import GenerationCore, PromptEncode, SharedEncodes
from gateway.core.metrics import RequestRecord
from gateway.core.request_id import check_request_id, new_request_id
from gateway.core.scoring import ScoringCore
from gateway.core.validation import GenerationRequest
from gateway.http_api.adapters_api import add_adapter_routes, model_cards
from gateway.http_api.disconnect import until_disconnect
from gateway.http_api.openai_errors import HttpError, add_error_handlers, error_body, error_response, grpc_code
from gateway.http_api.openai_format import ResponseFormat
from gateway.http_api.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    chat_request,
    choice_requests,
    completion_requests,
    off_loop,
    parse_body,
)
from gateway.http_api.pooling_api import add_pooling_routes
from gateway.http_api.tokenize_api import add_tokenize_routes
from rpcserver.auth import ApiKeyInterceptor


def sse(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n".encode()


class Deadline:
    """The time an HTTP request has, from its arrival: HTTP clients send no deadline, as gRPC ones do."""

    def __init__(self, seconds: float):
        self.seconds = seconds  # 0: none
        self.at = time.monotonic() + seconds

    def remaining(self) -> float | None:
        return max(0.0, self.at - time.monotonic()) if self.seconds else None

    def exceeded(self) -> HttpError:
        return HttpError(grpc.StatusCode.DEADLINE_EXCEEDED, f"the request did not finish within "
                         f"{self.seconds:g} s, the gateway's --http-request-timeout; it was cancelled")


async def recorded(core: GenerationCore, req: GenerationRequest, record: RequestRecord,
                   with_pieces: bool, deadline: Deadline, encodes: PromptEncode) -> AsyncIterator[Delta]:
    """The core's deltas for one choice, with its log line and metrics written however it ends.

    The deadline reaches every downstream call, as a gRPC caller's does: past it the worker's
    sequence is cancelled and the choice fails with DEADLINE_EXCEEDED.
    """
    error = None
    try:
        async for delta in core.generate(req, record, timeout=deadline.remaining, with_pieces=with_pieces,
                                         encodes=encodes):
            yield delta
    except BaseException as e:
        error = e
        if grpc_code(e) == grpc.StatusCode.DEADLINE_EXCEEDED and deadline.seconds:
            raise deadline.exceeded() from e
        raise
    finally:
        record.done(grpc_code(error))


class Choices:
    """The n generations of one request, read as one stream of (choice index, delta)."""

    def __init__(self, streams: list[AsyncIterator[Delta]]):
        self.streams = streams
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.running = len(streams)  # choices whose end marker has not been read yet

    async def first(self) -> list[tuple[int, Delta]]:
        """Every choice's first delta; raises the first error, so a refused request gets its HTTP status."""
        if len(self.streams) == 1:  # the common case, without a task and a queue per token
            return [(0, await anext(self.streams[0]))]
        self.tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(self.streams)]
        firsts, waiting = [], set(range(len(self.streams)))
        while waiting:
            index, item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            waiting.discard(index)
            if item is None:
                self.running -= 1
            else:
                firsts.append((index, item))
        return firsts

    async def rest(self) -> AsyncIterator[tuple[int, Delta]]:
        if not self.tasks:
            async for delta in self.streams[0]:
                yield 0, delta
            return
        while self.running:
            index, item = await self.queue.get()
            if item is None:
                self.running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item

    async def close(self) -> None:
        """Stops every generation still running (the worker frees their sequences).

        Also called from a cancelled request, so it must not wait on anything that can suspend:
        a task's cancellation runs its generation's cleanup, which cancels the calls at once.
        """
        if self.tasks:
            for task in self.tasks:
                task.cancel()
        else:
            await self.streams[0].aclose()

    async def _pump(self, index: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async for delta in stream:
                await self.queue.put((index, delta))
            await self.queue.put((index, None))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which answers with it
            await self.queue.put((index, e))


def create_app(core: GenerationCore, model_name: Callable[[], str], is_serving: Callable[[], bool],
               api_key: str | None, max_body_bytes: int, log_prompts: bool = False,
               request_timeout_s: float = 0) -> FastAPI:
    app = FastAPI(title="vllm-v0", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    checker = ApiKeyInterceptor(api_key) if api_key else None

    def check_model(requested: str) -> str:
        """The LoRA adapter a body's `model` names ("": the served model), or vLLM's answer to a model this server
        does not serve. No name means the served model, as in vLLM; a name is checked once the served one is
        known (--model-name, or a worker's answer): until then it is taken as an adapter, for the core to check."""
        served = model_name()
        if not requested or requested == served:
            return ""
        if not served or (core.adapters is not None and core.adapters.knows(requested)):
            return requested
        raise HttpError(grpc.StatusCode.NOT_FOUND, f"The model `{requested}` does not exist.", param="model",
                        error_type="NotFoundError", error_code=404)

    async def read_body(request: Request) -> bytes:
        if checker is not None:
            refusal = checker.refusal(request.headers.get("authorization"))
            if refusal is not None:
                raise HttpError(grpc.StatusCode.UNAUTHENTICATED, refusal)
        too_large = HttpError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"the request body is larger than {max_body_bytes} bytes", http_status=413)
        if int(request.headers.get("content-length") or 0) > max_body_bytes:
            raise too_large
        # A chunked body names no length: count it as it arrives, so the limit holds before it is all read.
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise too_large
        return bytes(body)

    def checked_requests(body: ChatRequest | CompletionRequest, chat: bool, adapter: str) -> list[GenerationRequest]:
        """The body's requests (one per prompt), each checked before any of them waits on the tokenizer or a
        worker."""
        reqs = [chat_request(body)] if chat else completion_requests(body)
        for req in reqs:
            req.adapter = adapter
            core.check(req)
        return reqs

    async def generate(request: Request, chat: bool) -> JSONResponse | StreamingResponse:
        deadline = Deadline(request_timeout_s)
        choices = None
        try:
            raw = await read_body(request)
            body = await parse_body(ChatRequest if chat else CompletionRequest, raw)
            adapter = check_model(body.model)
            reqs = await off_loop(len(raw), checked_requests, body, chat, adapter)
            want_logprobs = reqs[0].logprobs is not None
            request_id = request.headers.get("x-request-id", "")
            check_request_id(request_id)  # the gRPC request_id's rule
            request_id = request_id or new_request_id()
            # Choice p * n + i is prompt p's i-th, as OpenAI numbers them.
            per_choice = [r for req in reqs for r in choice_requests(req, body.n)]
            shared = SharedEncodes()  # a prompt is encoded once for its n choices, and for its repeats
            encodes = [shared.prompt() for _ in reqs]
            streams = []
            for index, r in enumerate(per_choice):
                prompt = _logged_prompt(r) if log_prompts else None
                record = RequestRecord(request_id if len(per_choice) == 1 else f"{request_id}-{index}", prompt)
                streams.append(recorded(core, r, record, want_logprobs, deadline, encodes[index // body.n]))
            choices = Choices(streams)
            fmt = ResponseFormat(chat, adapter or model_name(), len(per_choice), want_logprobs,
                                 choices_per_prompt=body.n)
            firsts = await choices.first()
        except Exception as e:  # noqa: BLE001 - refused before any output: a plain error response
            if choices is not None:
                await choices.close()
            return error_response(e)
        if body.stream:
            options = body.stream_options
            usage = options is not None and options.include_usage
            continuous = usage and options.continuous_usage_stats
            return StreamingResponse(stream_events(fmt, choices, firsts, usage, continuous),
                                     media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", "x-request-id": request_id})

        async def collect() -> None:
            for index, delta in firsts:
                fmt.add(index, delta)
            async for index, delta in choices.rest():
                fmt.add(index, delta)

        try:
            if not await until_disconnect(request, collect()):
                # Nobody is left to read the body; the cancel has freed the worker's sequences.
                return Response(status_code=499)
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        finally:
            await choices.close()
        # With an echoed prompt's logprobs the body is tens of thousands of entries: built and rendered on a thread.
        return await asyncio.to_thread(lambda: JSONResponse(fmt.body(), headers={"x-request-id": request_id}))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    async def served_models(request: Request) -> list[dict]:
        await read_body(request)
        return model_cards(core, model_name())

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            return {"object": "list", "data": await served_models(request)}
        except Exception as e:  # noqa: BLE001
            return error_response(e)

    # `:path`, as a hub id holds a slash (sent as it is, or percent-encoded as the openai client does).
    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        try:
            cards = await served_models(request)
            found = next((card for card in cards if card["id"] == model_id), None)
            if found is None:
                raise HttpError(grpc.StatusCode.NOT_FOUND, f"the model {model_id!r} does not exist; this server "
                                f"serves {', '.join(repr(card['id']) for card in cards)}", param="model",
                                error_code="model_not_found")
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        return found

    add_tokenize_routes(app, core, read_body, request_timeout_s or None, check_model)
    add_pooling_routes(app, EmbeddingCore(core.downstreams, core.limits_overrides, core.check_adapter),
                       ScoringCore(core.downstreams, core.limits_overrides, core.check_adapter), read_body, check_model,
                       model_name, lambda: Deadline(request_timeout_s))
    add_adapter_routes(app, core, read_body, model_name, request_timeout_s or None)

    @app.get("/health")
    async def health():
        # Open like gRPC health: probes need no key, and it says only whether the gateway serves.
        if is_serving():
            return {"status": "serving"}
        return JSONResponse({"status": "not serving"}, status_code=503)

    return app


async def stream_events(fmt: ResponseFormat, choices: Choices, firsts: list[tuple[int, Delta]],
                        include_usage: bool, continuous_usage: bool = False) -> AsyncIterator[bytes]:
    """Server-sent events: one `data:` line per delta, usage last when asked for (and in every chunk with
    vLLM's continuous_usage_stats), then [DONE].

    A client that disconnects cancels this generator; closing the choices cancels the worker's sequences.
    """
    try:
        for index, delta in firsts:
            # The first delta may carry an echoed prompt's logprobs: built and encoded on a thread.
            yield await asyncio.to_thread(lambda: sse(_with_usage(fmt, fmt.chunk(index, delta), include_usage,
                                                                  continuous_usage)))
        async for index, delta in choices.rest():
            yield sse(_with_usage(fmt, fmt.chunk(index, delta), include_usage, continuous_usage))
        if include_usage:
            yield sse(fmt.usage_chunk())
    except Exception as e:  # noqa: BLE001 - the status line is sent: the error goes in the stream
        yield sse(error_body(e)[1])
    finally:
        await choices.close()
    yield sse("[DONE]")


def _logged_prompt(req: GenerationRequest):
    if req.prompt is not None:
        return req.prompt
    return req.messages if req.messages is not None else req.prompt_token_ids


def _with_usage(fmt: ResponseFormat, chunk: dict, include_usage: bool, continuous: bool) -> dict:
    if include_usage:
        # As OpenAI: every chunk has the key, only the last one a value (unless asked for in each).
        chunk["usage"] = fmt.usage() if continuous else None
    return chunk
