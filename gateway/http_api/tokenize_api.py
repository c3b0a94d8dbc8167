"""vLLM's /tokenize and /detokenize routes: the served tokenizer and chat template, without generating."""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request

from gateway.core.generation import GenerationCore
from gateway.core.validation import GenerationRequest, check_for_worker
from gateway.http_api.openai_errors import error_response
from gateway.http_api.openai_protocol import (
    ChatRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_request,
    off_loop,
    parse_body,
)
from rpcserver.errors import InvalidArgument
from vllm_v0.tokenizer.v1 import tokenizer_pb2


def tokenize_request(body: TokenizeRequest) -> GenerationRequest:
    """The prompt or chat as the generation endpoints would read it."""
    if (body.prompt is None) == (body.messages is None):
        raise InvalidArgument("give exactly one of prompt and messages")
    if body.prompt is not None:
        if body.tools:
            raise InvalidArgument("tools need messages: a prompt is not rendered with the chat template")
        return GenerationRequest(prompt=body.prompt)
    return chat_request(ChatRequest(messages=body.messages, tools=body.tools,
                                    chat_template_kwargs=body.chat_template_kwargs))


def add_tokenize_routes(app: FastAPI, core: GenerationCore, read_body: Callable[[Request], Awaitable[bytes]],
                        timeout: float | None, check_model: Callable[[str], None]) -> None:
    """`timeout`: seconds each tokenizer call may take (the gateway's --http-request-timeout; None: no limit);
    `check_model`: the generation routes' check of a body's `model` (an unknown one is a 404)."""
    def checked_request(body: TokenizeRequest) -> GenerationRequest:
        req = tokenize_request(body)
        core.check(req)
        return req

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            raw = await read_body(request)
            body = await parse_body(TokenizeRequest, raw)
            check_model(body.model)
            # Invalid on its face: a 400 at once, even while no worker serves (the limits wait for one).
            req = await off_loop(len(raw), checked_request, body)
            limits = core.limits()
            check_for_worker(req, limits)
            add_special_tokens = body.add_special_tokens
            if add_special_tokens is None:
                add_special_tokens = body.prompt is not None
            ids, _ = await core.encode(req, timeout, body.add_generation_prompt, add_special_tokens)
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        return {"count": len(ids), "max_model_len": limits.max_context, "tokens": list(ids), "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        try:
            body = await parse_body(DetokenizeRequest, await read_body(request))
            check_model(body.model)
            if any(token < 0 for token in body.tokens):
                raise InvalidArgument("tokens must be token ids >= 0")
            reply = await core.downstreams.tokenizer.Decode(tokenizer_pb2.DecodeRequest(token_ids=body.tokens),
                                                              timeout=timeout)
        except Exception as e:  # noqa: BLE001
            return error_response(e)
        return {"prompt": reply.text}
