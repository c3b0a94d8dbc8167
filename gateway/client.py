"""Command-line client: streams a completion from the gateway to stdout."""

import argparse
import os
import sys

import grpc

from rpcserver.shared import MAX_SEED, SAMPLING_FIELDS
from rpcserver.version import add_version_flag
from vllm_v0.gateway.v1 import gateway_pb2, gateway_pb2_grpc

# Flags copied into the request only when given, so the server's defaults apply otherwise.
_OPTIONAL_FIELDS = ("max_tokens", *SAMPLING_FIELDS, "logprobs")
# Unset, the server would generate up to the rest of the context (thousands of tokens, minutes on a CPU).
DEFAULT_MAX_TOKENS = 256
UINT32_MAX, INT32_MAX = 2**32 - 1, 2**31 - 1


def int_in(low: int, high: int):
    """An argparse type for an integer in [low, high]: the proto field's range, so a bad value is
    a one-line usage error here rather than a ValueError from protobuf after parsing."""
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value
    return convert


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gateway.client", description=__doc__)
    add_version_flag(parser, "gateway.client")
    parser.add_argument("text", help="the prompt, or with --chat the user message")
    parser.add_argument(
        "--addr",
        default=os.environ.get("VLLM_V0_GATEWAY_ADDR", "localhost:50051"),
        help="gateway host:port (default: $VLLM_V0_GATEWAY_ADDR or localhost:50051)",
    )
    chat = parser.add_argument_group("chat")
    chat.add_argument("--chat", action="store_true", help="send TEXT as a user message")
    chat.add_argument("--system", help="add a system message first (implies --chat)")
    chat.add_argument("--no-think", action="store_true", help="turn Qwen3's thinking off")

    sampling = parser.add_argument_group("sampling (unset: the checkpoint's defaults)")
    sampling.add_argument("--max-tokens", type=int_in(0, UINT32_MAX), default=DEFAULT_MAX_TOKENS,
                          help="most tokens to generate (default: %(default)s; 0: up to the rest of the context)")
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int_in(-1, INT32_MAX))
    sampling.add_argument("--min-p", type=float)
    sampling.add_argument("--repetition-penalty", type=float)
    sampling.add_argument("--presence-penalty", type=float)
    sampling.add_argument("--frequency-penalty", type=float)
    sampling.add_argument("--seed", type=int_in(0, MAX_SEED))
    sampling.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    sampling.add_argument(
        "--stop-token-id", type=int_in(0, UINT32_MAX), action="append", default=[], help="stop token id (repeatable)"
    )
    sampling.add_argument("--ignore-eos", action="store_true")
    sampling.add_argument(
        "--logprobs", type=int_in(0, UINT32_MAX), metavar="N", help="print each token's logprob and N alternatives"
    )
    sampling.add_argument("--keep-special-tokens", action="store_true")

    conn = parser.add_argument_group("connection")
    conn.add_argument("--timeout", type=float, help="deadline for the whole request, in seconds")
    conn.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_V0_API_KEY"),
        help="sent as 'authorization: Bearer KEY' (default: $VLLM_V0_API_KEY)",
    )
    conn.add_argument("--tls-ca", metavar="FILE", help="root certificate: connect over TLS")
    conn.add_argument("--request-id", default="", help="id echoed in the server's logs")
    return parser.parse_args(argv)


def build_request(args: argparse.Namespace) -> gateway_pb2.GenerateRequest:
    """The GenerateRequest the flags describe; unset flags stay unset in the proto."""
    req = gateway_pb2.GenerateRequest(
        stop=args.stop,
        stop_token_ids=args.stop_token_id,
        ignore_eos=args.ignore_eos,
        request_id=args.request_id,
    )
    if args.chat or args.system is not None:
        if args.system is not None:
            req.messages.add(role="system", content=args.system)
        req.messages.add(role="user", content=args.text)
    else:
        req.prompt = args.text
    if args.no_think:
        req.enable_thinking = False
    for name in _OPTIONAL_FIELDS:
        value = getattr(args, name)
        if value is not None and not (name == "max_tokens" and value == 0):
            setattr(req, name, value)
    if args.keep_special_tokens:
        req.skip_special_tokens = False
    return req


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    if args.tls_ca is None:
        return grpc.insecure_channel(args.addr)
    with open(args.tls_ca, "rb") as f:
        credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    return grpc.secure_channel(args.addr, credentials)


def stream(args: argparse.Namespace) -> int:
    """Runs one request, printing text as it arrives; returns the exit code."""
    metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
    with open_channel(args) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        call = stub.Generate(build_request(args), timeout=args.timeout, metadata=metadata)
        last, logprobs, ends_line = None, [], True
        try:
            for response in call:
                if response.reasoning_text:
                    # Qwen3's thinking goes to stderr, so stdout holds the answer alone.
                    sys.stderr.write(response.reasoning_text)
                    sys.stderr.flush()
                for piece in response.tool_calls:
                    print(f"\ntool call {piece.id}: {piece.name}" if piece.name else piece.arguments,
                          end="" if not piece.name else " ", file=sys.stderr)
                if response.text:
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
                    ends_line = response.text.endswith("\n")
                # A message's text delta goes beside its last token: with one token per message that is the
                # token's text (empty while a character is split); tokens that came together share one text.
                last_entry = len(response.logprobs) - 1
                logprobs.extend((entry, response.text if i == last_entry else "")
                                for i, entry in enumerate(response.logprobs))
                last = response
        except KeyboardInterrupt:
            # Cancelling tells the gateway to stop generating, freeing the worker's slot.
            call.cancel()
            print("\ncancelled", file=sys.stderr)
            return 130
        except grpc.RpcError as err:
            print(f"\nerror: {describe_error(err)}", file=sys.stderr)
            return 1
    if not ends_line:
        # On a terminal, end the text's line; piped, the completion stays exact and the summary on
        # stderr starts a line of its own (the two may share a file).
        print(file=sys.stdout if sys.stdout.isatty() else sys.stderr)
    if logprobs:
        print_logprobs(logprobs)
    if last is not None:
        print_summary(last)
    return 0


def describe_error(err: grpc.RpcError) -> str:
    message = f"{err.code().name}: {err.details()}"
    if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in (err.details() or ""):
        message += (" (the request is larger than the server's --max-message-bytes: shorten it or raise that "
                    "limit; retrying will not help)")
    return message


def print_logprobs(logprobs: list[tuple[gateway_pb2.Logprobs, str]]) -> None:
    """One line per token: its id, its text, its logprob, then the alternatives as id:logprob."""
    for entry, text in logprobs:
        top = "  ".join(f"{t.token_id}:{t.logprob:.3f}" for t in entry.top)
        chosen = entry.chosen
        print(f"{chosen.token_id:>8} {text!r:>14} {chosen.logprob:9.4f}  {top}", file=sys.stderr)


def print_summary(last: gateway_pb2.GenerateResponse) -> None:
    finish = gateway_pb2.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_")
    lines = [
        f"finish_reason: {finish.lower()}",
        f"stop_reason: {last.stop_reason!r}" if last.stop_reason else None,
        f"prompt_tokens: {last.usage.prompt_tokens}",
        f"completion_tokens: {last.usage.completion_tokens}",
        f"time_to_first_token: {last.time_to_first_token_s:.3f} s",
        f"request_id: {last.request_id}" if last.request_id else None,
    ]
    print("\n".join(line for line in lines if line), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return stream(args)
    except OSError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C outside the stream (connecting, printing the summary): no traceback.
        return 130


if __name__ == "__main__":
    sys.exit(main())
