"""python -m services.tokenizer: serve a checkpoint's tokenizer and chat template as TokenizerService."""
from __future__ import annotations

import argparse
import asyncio
import logging
import time

import jinja2

from checkpoint.path import TOKENIZER_FILES, resolve_model
from rpcserver.auth import add_auth_flags, auth_interceptors
from rpcserver.config import SERVER_FLAG_RANGES, ServerConfig, add_flag, add_server_flags, check_ranges
from rpcserver.handlers import add_servicer
from rpcserver.priority import NICE_RANGE, add_nice_flag, lower_priority
from rpcserver.server import GrpcServer, setup_logging
from services.tokenizer.core import TokenizerCore, TokenizerLoadError
from services.tokenizer.decode_batches import StreamLimits
from services.tokenizer.servicer import DEFAULT_THREADS, TokenizerServicer
from vllm_v0.tokenizer.v1 import tokenizer_pb2

log = logging.getLogger("tokenizer")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.tokenizer", description=__doc__.split(":", 1)[1])
    add_server_flags(parser, default_port=50052)
    add_flag(parser, "--model", "demo-model", "checkpoint directory (tokenizer.json, tokenizer_config.json, "
             "generation_config.json), or a hub id such as Qwen/Qwen3-0.6B")
    add_flag(parser, "--max-decode-streams", StreamLimits.max_streams, "most streams one DecodeBatches call may "
             "hold open; a new one past it replaces the least recently used if that one is idle, else is refused")
    add_flag(parser, "--decode-stream-idle-timeout", StreamLimits.idle_s, "seconds without an item after which "
             "a DecodeBatches stream may be dropped to make room for a new one (a caller that never sends final)")
    add_flag(parser, "--tokenize-threads", DEFAULT_THREADS, "threads that encode, render chat templates and decode "
             "long inputs, off the event loop that carries every stream's text")
    add_nice_flag(parser)
    add_auth_flags(parser)  # for deployments without mTLS; the gateway sends its --downstream-api-key
    args = parser.parse_args(argv)
    check_ranges(parser, args, (*SERVER_FLAG_RANGES, NICE_RANGE, ("--max-decode-streams", 1, None),
                                ("--decode-stream-idle-timeout", 0, None), ("--tokenize-threads", 1, None)))
    return args


async def serve(args: argparse.Namespace) -> None:
    service = tokenizer_pb2.DESCRIPTOR.services_by_name["TokenizerService"]
    server = GrpcServer(ServerConfig.from_args(args), [service.full_name], interceptors=auth_interceptors(args))
    servicer = TokenizerServicer(stream_limits=StreamLimits(args.max_decode_streams, args.decode_stream_idle_timeout,
                                                            args.max_message_bytes),
                                 threads=args.tokenize_threads)
    add_servicer(server.server, service, servicer)
    await server.start()  # health answers NOT_SERVING while the tokenizer loads
    try:
        await serve_started(args, server, servicer)
    finally:
        await server.close()  # on this loop, or grpc's __del__ tries after it closed


async def serve_started(args: argparse.Namespace, server: GrpcServer, servicer: TokenizerServicer) -> None:
    start = time.perf_counter()
    checkpoint = resolve_model(args.model, TOKENIZER_FILES)  # a hub id: no weights
    try:
        core = await asyncio.to_thread(TokenizerCore.from_dir, checkpoint)
    except (TokenizerLoadError, jinja2.TemplateError) as e:  # a missing file, a template that does not compile
        raise SystemExit(f"cannot serve {args.model}: {e}") from None
    log.info("loaded tokenizer from %s in %.1f s: %d ids, eos %s, chat template: %s", checkpoint,
             time.perf_counter() - start, core.info.vocab_size, core.info.eos_token_ids,
             "yes" if core.info.has_chat_template else "no")
    servicer.core = core
    await server.set_serving(True)
    await server.run_until_signal()


def main(argv=None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_level)
    lower_priority(args.nice)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
