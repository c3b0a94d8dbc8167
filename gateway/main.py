"""python -m gateway: the public GatewayService in front of the tokenizer service and the model workers."""
from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable

import grpc
from prometheus_client import REGISTRY

from gateway.core.generation import GenerationCore
from gateway.fleet.adapters import Adapters
from gateway.fleet.downstream import WORKER_STREAMS, Downstreams, DownstreamTLS
from gateway.fleet.fleet_metrics import FleetCollector
from gateway.fleet.router import POLICIES, Router, RouterConfig
from gateway.fleet.worker_stream import ResumePolicy
from gateway.fleet.workers import parse_targets
from gateway.grpc_api.servicer import GatewayServicer
from gateway.http_api.http_app import create_app
from gateway.http_api.http_server import HttpServer
from rpcserver.auth import add_auth_flags, api_key_from_args, auth_interceptors, read_api_key
from rpcserver.config import SERVER_FLAG_RANGES, ServerConfig, add_flag, add_server_flags, check_ranges, env_default
from rpcserver.handlers import add_servicer
from rpcserver.priority import NICE_RANGE, add_nice_flag, lower_priority
from rpcserver.server import GrpcServer, setup_logging
from vllm_v0.gateway.v1 import gateway_pb2

log = logging.getLogger("gateway")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__.split(":", 1)[1])
    add_server_flags(parser, default_port=50051)
    parser.add_argument("--tokenizer-addr", action="append", default=[], help="tokenizer service addresses, "
                        "comma-separated and repeatable; a call to one that is unavailable goes to another, and "
                        "dns:///host:port stands for every address the name resolves to, re-resolved every "
                        "--health-interval (default: localhost:50052) [env VLLM_V0_TOKENIZER_ADDR]")
    parser.add_argument("--worker-addr", action="append", default=[], help="model worker addresses, comma-separated "
                        "and repeatable; dns:///host:port stands for every address the name resolves to, re-resolved "
                        "every --health-interval (default: localhost:50053) [env VLLM_V0_WORKER_ADDR]")
    add_flag(parser, "--routing", "cache-aware", "how requests are spread over the workers: cache-aware (the "
             "worker holding most of the prompt's leading blocks, unless overloaded; misses by load), least-load "
             "or round-robin", choices=POLICIES)
    add_flag(parser, "--worker-stream", "multiplexed", "how requests travel to a worker: multiplexed (one "
             "GenerateMany call per worker, one message per engine step for all its requests) or per-request (a "
             "Generate call each)", choices=WORKER_STREAMS)
    add_flag(parser, "--stream-interval", 1, "tokens per streamed message while the client keeps up: 1 sends "
             "each token as it comes; N holds tokens until N are ready (the first and last never wait). Either "
             "way, tokens that come faster than messages go out are merged into one message")
    add_flag(parser, "--stream-message-rate", 5000, "messages a second the gateway aims to send over all its streams: "
             "with S streams open, each waits S/N seconds after a message before it takes its next tokens, which "
             "then go out together (the first and last tokens never wait; with few streams nothing waits). 0: a "
             "message whenever tokens are ready")
    add_flag(parser, "--model-name", "", "the model's id in GetInfo and the HTTP API (default: the worker's: its "
             "checkpoint's folder name, or the hub id given as --model)")
    add_flag(parser, "--max-prompt-tokens", 0, "longest prompt accepted, in tokens (0: the context minus one)")
    add_flag(parser, "--max-tokens-limit", 0, "largest max_tokens accepted (0: the context)")
    add_flag(parser, "--max-stop-strings", 8, "most stop strings per request")
    add_flag(parser, "--max-stop-string-chars", 128, "longest stop string, in characters")
    add_flag(parser, "--max-logprobs", 20, "most top logprobs per token")
    add_flag(parser, "--max-prompt-chars", 1_000_000, "longest prompt, in characters; for a chat, its contents, "
             "tools' JSON and past tool calls together. Checked before anything is encoded")
    add_flag(parser, "--downstream-tls-ca", None, "CA bundle to verify the tokenizer and worker (TLS to them)")
    add_flag(parser, "--downstream-tls-cert", None, "client certificate presented to them (mTLS)")
    add_flag(parser, "--downstream-tls-key", None, "key of --downstream-tls-cert")
    # Not add_flag, as for --api-key: its help would print a key taken from the environment.
    parser.add_argument("--downstream-api-key", default=env_default("--downstream-api-key", None),
                        help="sent as 'authorization: Bearer KEY' on every call to the tokenizer and workers, "
                             "for ones started with --api-key (default: this gateway's own --api-key, so one "
                             "key set for all three services works) [env VLLM_V0_DOWNSTREAM_API_KEY]")
    parser.add_argument("--downstream-api-key-file", default=env_default("--downstream-api-key-file", None),
                        help="read --downstream-api-key from this file [env VLLM_V0_DOWNSTREAM_API_KEY_FILE]")
    add_flag(parser, "--http-port", 0, "serve the OpenAI-compatible HTTP API on this port too (0: off)")
    add_flag(parser, "--http-request-timeout", 600.0, "seconds an HTTP generation request may take, from its "
             "arrival to its last token; past it the request is cancelled on the worker and answered 504 (or an "
             "error event) (0: no limit). gRPC callers set their own deadline")
    add_flag(parser, "--health-interval", 1.0, "seconds between checks of the downstream services (and DNS "
             "lookups of dns:/// worker addresses)")
    add_flag(parser, "--max-resumes", 3, "times one request's stream is carried on after what it runs on fails "
             "(its worker, the worker's engine core, the tokenizer's text stream): on another worker, or on the "
             "same one once it serves again, after the tokens already sent (0: never; a failure ends the stream)")
    add_flag(parser, "--resume-wait", 30.0, "longest a broken stream waits for a worker or tokenizer to serve it "
             "again, within the request's own deadline; past it the stream ends UNAVAILABLE")
    add_flag(parser, "--log-prompts", False, "add each request's prompt text to its log line (off: prompts are "
             "user data)")
    add_nice_flag(parser)
    add_auth_flags(parser)
    args = parser.parse_args(argv)
    args.tokenizer_addr = parse_targets(args.tokenizer_addr or [env_default("--tokenizer-addr", "localhost:50052")])
    args.worker_addr = parse_targets(args.worker_addr or [env_default("--worker-addr", "localhost:50053")])
    # The context-dependent bounds (--max-prompt-tokens below the worker's context, --max-logprobs
    # at most the worker's) are applied once the worker has answered GetInfo.
    check_ranges(parser, args, (*SERVER_FLAG_RANGES, NICE_RANGE, ("--max-prompt-tokens", 0, None),
                                ("--max-tokens-limit", 0, None),
                                ("--max-stop-strings", 0, None), ("--max-stop-string-chars", 1, None),
                                ("--max-logprobs", 0, None), ("--max-prompt-chars", 1, None),
                                ("--health-interval", 0.01, None), ("--http-port", 0, 65535),
                                ("--stream-interval", 1, None), ("--stream-message-rate", 0, None),
                                ("--max-resumes", 0, None),
                                ("--resume-wait", 0, None),
                                ("--http-request-timeout", 0, None)))
    return args


def downstream_api_key(args: argparse.Namespace) -> str | None:
    """The key sent to the tokenizer and workers: --downstream-api-key, else the gateway's own key."""
    return (read_api_key(args.downstream_api_key, args.downstream_api_key_file, "--downstream-api-key")
            or api_key_from_args(args))


def limits_overrides(args: argparse.Namespace) -> dict:
    return dict(max_prompt_tokens=args.max_prompt_tokens or None, max_tokens_limit=args.max_tokens_limit or None,
                max_stop_strings=args.max_stop_strings, max_stop_string_chars=args.max_stop_string_chars,
                max_logprobs=args.max_logprobs, max_prompt_chars=args.max_prompt_chars)


def served_model_name(flag: str, downstreams: Downstreams) -> Callable[[], str]:
    """The model's id in the HTTP API: --model-name, else the workers'. The last one seen is kept while no
    worker answers (one restarting), so requests for another model are still refused as unknown."""
    last = flag

    def name() -> str:
        nonlocal last
        info = downstreams.worker_info
        if not flag and info is not None:
            last = info.model
        return last
    return name


async def watch_downstreams(server: GrpcServer, downstreams: Downstreams, interval: float) -> None:
    """Serve only while the tokenizer and at least one worker do; refetch the tokenizer's facts when it comes back."""
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
                log.info("serving: tokenizer at %s and %d of the workers at %s are up (max context %d)",
                         downstreams.addresses["tokenizer"], len(downstreams.fleet.serving()),
                         downstreams.addresses["worker"], downstreams.worker_info.max_context)
            else:
                down = [f"{n} at {downstreams.addresses[n]}" for n, up in health.items() if not up]
                log.warning("not serving: waiting for %s", ", ".join(down) or "downstream info")
            serving = ok
        # A worker joining or leaving changes the answer at once; otherwise look again each interval.
        downstreams.fleet.changed.clear()
        try:
            await asyncio.wait_for(downstreams.fleet.changed.wait(), interval)
        except TimeoutError:
            pass


async def serve(args: argparse.Namespace) -> None:
    service = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"]
    server = GrpcServer(ServerConfig.from_args(args), [service.full_name], interceptors=auth_interceptors(args))
    downstreams = Downstreams(args.tokenizer_addr, args.worker_addr,
                              DownstreamTLS(args.downstream_tls_ca, args.downstream_tls_cert, args.downstream_tls_key),
                              args.health_interval, Router(RouterConfig(args.routing)), args.worker_stream,
                              downstream_api_key(args), args.max_message_bytes,
                              ResumePolicy(args.max_resumes, args.resume_wait))
    REGISTRY.register(FleetCollector(downstreams.fleet))
    core = GenerationCore(downstreams, limits_overrides(args), args.stream_interval, Adapters(downstreams.fleet),
                          args.stream_message_rate)
    add_servicer(server.server, service,
                 GatewayServicer(core, args.model_name, args.log_prompts, args.max_message_bytes))
    await server.start()
    await downstreams.start()
    http = None
    if args.http_port:
        app = create_app(core, served_model_name(args.model_name, downstreams), lambda: server.serving,
                         api_key_from_args(args), args.max_message_bytes, args.log_prompts,
                         request_timeout_s=args.http_request_timeout)
        http = HttpServer(app, server.config, args.http_port, args.log_level)
        await http.start()
        log.info("serving the OpenAI-compatible HTTP API on %s:%d", args.host, http.port)
    watcher = asyncio.create_task(watch_downstreams(server, downstreams, args.health_interval))

    async def stop_watching() -> None:
        watcher.cancel()
        await downstreams.close()

    await server.run_until_signal(on_stop=stop_watching, on_drain=http.stop if http else None)


def main(argv=None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_level)
    lower_priority(args.nice)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
