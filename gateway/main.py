"""python -m gateway: the public GatewayService in front of the tokenizer service and the model worker."""
from __future__ import annotations

import argparse
import asyncio
import logging

import grpc

from gateway.downstream import Downstreams, DownstreamTLS
from gateway.servicer import GatewayServicer
from rpcserver.auth import add_auth_flags, auth_interceptors
from rpcserver.config import SERVER_FLAG_RANGES, ServerConfig, add_flag, add_server_flags, check_ranges
from rpcserver.handlers import add_servicer
from rpcserver.server import GrpcServer, setup_logging
from vllm_v0.gateway.v1 import gateway_pb2

log = logging.getLogger("gateway")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__.split(":", 1)[1])
    add_server_flags(parser, default_port=50051)
    add_flag(parser, "--tokenizer-addr", "localhost:50052", "address of the tokenizer service")
    add_flag(parser, "--worker-addr", "localhost:50053", "address of the model worker")
    add_flag(parser, "--model-name", "", "model name reported by GetInfo (default: the worker's --model)")
    add_flag(parser, "--max-prompt-tokens", 0, "longest prompt accepted, in tokens (0: the context minus one)")
    add_flag(parser, "--max-tokens-limit", 0, "largest max_tokens accepted (0: the context)")
    add_flag(parser, "--max-stop-strings", 8, "most stop strings per request")
    add_flag(parser, "--max-stop-string-chars", 128, "longest stop string, in characters")
    add_flag(parser, "--max-logprobs", 20, "most top logprobs per token")
    add_flag(parser, "--max-prompt-chars", 1_000_000, "longest prompt (or chat) text, in characters")
    add_flag(parser, "--downstream-tls-ca", None, "CA bundle to verify the tokenizer and worker (TLS to them)")
    add_flag(parser, "--downstream-tls-cert", None, "client certificate presented to them (mTLS)")
    add_flag(parser, "--downstream-tls-key", None, "key of --downstream-tls-cert")
    add_flag(parser, "--health-interval", 1.0, "seconds between checks of the downstream services")
    add_flag(parser, "--log-prompts", False, "add each request's prompt text to its log line (off: prompts are "
             "user data)")
    add_auth_flags(parser)
    args = parser.parse_args(argv)
    # The context-dependent bounds (--max-prompt-tokens below the worker's context, --max-logprobs
    # at most the worker's) are applied once the worker has answered GetInfo.
    check_ranges(parser, args, (*SERVER_FLAG_RANGES, ("--max-prompt-tokens", 0, None), ("--max-tokens-limit", 0, None),
                                ("--max-stop-strings", 0, None), ("--max-stop-string-chars", 1, None),
                                ("--max-logprobs", 0, None), ("--max-prompt-chars", 1, None),
                                ("--health-interval", 0.01, None)))
    return args


def limits_overrides(args: argparse.Namespace) -> dict:
    return dict(max_prompt_tokens=args.max_prompt_tokens or None, max_tokens_limit=args.max_tokens_limit or None,
                max_stop_strings=args.max_stop_strings, max_stop_string_chars=args.max_stop_string_chars,
                max_logprobs=args.max_logprobs, max_prompt_chars=args.max_prompt_chars)


async def watch_downstreams(server: GrpcServer, downstreams: Downstreams, interval: float) -> None:
    """Serve only while both services do; refetch their facts whenever they come back."""
    serving = None
    while True:
        health = await downstreams.healthy()
        ok = all(health.values())
        if ok and not serving:
            try:
                await downstreams.refresh_info()
            except grpc.aio.AioRpcError as e:
                log.warning("downstreams are healthy but GetInfo failed: %s", e.code().name)
                ok = False
        if ok != serving:
            await server.set_serving(ok)
            if ok:
                log.info("serving: tokenizer at %s and worker at %s are up (max context %d)",
                         downstreams.addresses["tokenizer"], downstreams.addresses["worker"],
                         downstreams.worker_info.max_context)
            else:
                down = [f"{n} at {downstreams.addresses[n]}" for n, up in health.items() if not up]
                log.warning("not serving: waiting for %s", ", ".join(down) or "downstream info")
            serving = ok
        await asyncio.sleep(interval)


async def serve(args: argparse.Namespace) -> None:
    service = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"]
    server = GrpcServer(ServerConfig.from_args(args), [service.full_name], interceptors=auth_interceptors(args))
    downstreams = Downstreams(args.tokenizer_addr, args.worker_addr,
                              DownstreamTLS(args.downstream_tls_ca, args.downstream_tls_cert, args.downstream_tls_key))
    add_servicer(server.server, service,
                 GatewayServicer(downstreams, limits_overrides(args), args.model_name, args.log_prompts))
    await server.start()
    watcher = asyncio.create_task(watch_downstreams(server, downstreams, args.health_interval))

    async def stop_watching() -> None:
        watcher.cancel()
        await downstreams.close()

    await server.run_until_signal(on_stop=stop_watching)


def main(argv=None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
