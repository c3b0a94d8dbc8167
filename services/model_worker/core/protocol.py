"""What crosses the socket between the worker and its engine core: length-prefixed JSON frames, never pickle.

Worker to core: {"type": "add", "id", "prompt", "params", "output", "seed", "resume"}, {"type": "pool", "id",
"prompt", "pooling", "adapter"}, {"type": "abort", "id"}, {"type": "shutdown"}; params is SamplingParams as a
dict, its structured_output a {"kind", "value"} object or null; pooling is PoolingParams as a dict (a prompt-only
request; its "adapter" is optional, as an add's).
An add's last three are optional: "output" holds the ids a broken stream of the request already generated (absent
or empty: a new request), "seed" seeds the draws of a request whose params have none, and "resume": true marks the
worker carrying its own stream on after a core restart, which no queue limit refuses. An add (or pool) may name a
LoRA adapter: "adapter". {"type": "load_adapter", "id", "name", "path"} and {"type": "unload_adapter", "id", "name"}
change the adapters; the next update answers each in "adapter_replies": [id, error kind ("": done), message, the
adapter's {"name", "path", "rank"} or null], beside "adapters", every adapter loaded then.
Core to worker: {"type": "ready", "info"} once the model is loaded, or {"type": "failed", "message"} if it
cannot load; then {"type": "update", "outputs", "errors", "step_seconds", "stats", "kv_stored", "kv_evicted"} after every
step, and after applying commands that left nothing to step; kv_stored and kv_evicted are the hex block hashes
the prefix cache gained and lost since the last update. Each output is [id, token, prompt tokens] when that is all
it says (no logprobs, no finish, no prompt logprobs, no proposals counted), else output_to_list's eight fields.
An update after a step that ended pooling requests also holds "pooled": [id, values as base64 of little-endian
float32, prompt tokens] for each. The core's last update before it ends after a failed step also holds "dead":
why, and an UNAVAILABLE error for every open request.
"""
from __future__ import annotations

import array
import asyncio
import base64
import dataclasses
import json
import signal
import struct
import sys
from typing import BinaryIO

from rpcserver.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, ServiceError, Unavailable
from services.model_worker.config.sampling import SamplingParams
from services.model_worker.engine.llm_engine import StepOutput
from services.model_worker.engine.pooling import PoolingOutput, PoolingParams
from services.model_worker.engine.sequence import FinishReason

_HEADER = struct.Struct(">I")  # body length in bytes
# The core's exit code after a step failed (EngineDeadError): the worker fails its streams and starts a new core.
EXIT_ENGINE_DEAD = 4
# The core answers this signal with every thread's stack on stderr (faulthandler), also inside a C call.
DUMP_STACKS_SIGNAL = signal.SIGUSR1
ERROR_KINDS: dict[str, type[ServiceError]] = {
    "invalid_argument": InvalidArgument,
    "resource_exhausted": ResourceExhausted,
    "unavailable": Unavailable,
    "not_found": NotFound,
    "failed_precondition": FailedPrecondition,
}


class ProtocolError(Exception):
    """A frame that is not what the other side should have sent."""


def encode(message: dict) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(len(body)) + body


def _decode(body: bytes) -> dict:
    try:
        message = json.loads(body)
    except ValueError as e:
        raise ProtocolError(f"a frame is not JSON: {e}") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError(f"a frame has no message type: {body[:80]!r}")
    return message


def read_blocking(stream: BinaryIO) -> dict | None:
    """The next frame from a file object over the socket; None at end of file."""
    header = stream.read(_HEADER.size)
    if not header:
        return None
    if len(header) < _HEADER.size:
        raise ProtocolError("the socket closed inside a frame header")
    (size,) = _HEADER.unpack(header)
    body = stream.read(size)
    if len(body) < size:
        raise ProtocolError("the socket closed inside a frame")
    return _decode(body)


# A frame this large (a long prompt's logprobs, say) is decoded on a thread: its JSON takes tens of
# milliseconds, and the reader of the frames runs on the worker front's event loop.
OFF_LOOP_FRAME_BYTES = 256 << 10


async def read_async(reader: asyncio.StreamReader) -> dict | None:
    """The next frame from an asyncio stream; None at end of file (even inside a frame: the writer is gone)."""
    try:
        (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
        body = await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    # Frames stay in order: the caller awaits each one before it reads the next.
    return await asyncio.to_thread(_decode, body) if size > OFF_LOOP_FRAME_BYTES else _decode(body)


# -- payloads -------------------------------------------------------------------------------------------


def params_to_dict(params: SamplingParams) -> dict:
    return dataclasses.asdict(params)


def params_from_dict(raw: dict) -> SamplingParams:
    return SamplingParams(**raw)


def output_to_list(output: StepOutput) -> list:
    """[request id, token, prompt tokens] for a token with nothing else to say (most tokens of most steps: a
    third of the JSON to write and read), else every field."""
    reason = output.finish_reason
    if (reason is None and output.logprob is None and not output.top_logprobs and output.prompt_logprobs is None
            and output.spec_accepted is None):
        return [output.request_id, output.token_id, output.prompt_tokens]
    return [output.request_id, output.token_id, output.logprob, [list(t) for t in output.top_logprobs],
            reason.value if reason is not None else None, output.prompt_tokens, output.prompt_logprobs,
            output.spec_accepted]


def output_from_list(raw: list) -> StepOutput:
    if len(raw) == 3:
        request_id, token_id, prompt_tokens = raw
        return StepOutput(request_id, token_id, None, [], None, prompt_tokens)
    request_id, token_id, logprob, top_logprobs, reason, prompt_tokens, prompt_logprobs, spec_accepted = raw
    if prompt_logprobs is not None:  # JSON made the tuples lists
        prompt_logprobs = [None if p is None else (p[0], [(t, lp) for t, lp in p[1]]) for p in prompt_logprobs]
    return StepOutput(request_id, token_id, logprob, [(t, lp) for t, lp in top_logprobs],
                      FinishReason(reason) if reason is not None else None, prompt_tokens, prompt_logprobs,
                      spec_accepted)


def pooling_from_dict(raw: dict) -> PoolingParams:
    return PoolingParams(**raw)


def pooled_to_list(output: PoolingOutput) -> list:
    # As float32 bytes: exact, and about a quarter of the size of the same values written as JSON numbers.
    values = array.array("f", output.values)
    if sys.byteorder != "little":
        values.byteswap()
    return [output.request_id, base64.b64encode(values.tobytes()).decode("ascii"), output.prompt_tokens]


def pooled_from_list(raw: list) -> PoolingOutput:
    request_id, encoded, prompt_tokens = raw
    values = array.array("f", base64.b64decode(encoded))
    if sys.byteorder != "little":
        values.byteswap()
    return PoolingOutput(request_id, values.tolist(), prompt_tokens)


def error_to_list(request_id: str, error: ServiceError) -> list:
    kind = next((k for k, cls in ERROR_KINDS.items() if isinstance(error, cls)), "unavailable")
    return [request_id, kind, str(error)]


def error_from_list(raw: list) -> tuple[str, ServiceError]:
    request_id, kind, message = raw
    return request_id, ERROR_KINDS.get(kind, Unavailable)(message)
