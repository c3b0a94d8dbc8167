"""Request ids: the caller's, checked before it reaches a log line, and the gateway's own for the worker."""
from __future__ import annotations

import re
import uuid

from rpcserver.errors import InvalidArgument

# As OpenAI's and vLLM's ids go (`chatcmpl-...`, uuids, trace ids): room for any of them, and nothing
# that can split or forge a log line (newlines, control characters) or hide in one (spaces).
MAX_REQUEST_ID_CHARS = 128
_ALLOWED = re.compile(r"[\x21-\x7e]*")
RULE = f"at most {MAX_REQUEST_ID_CHARS} printable ASCII characters, without spaces or control characters"


def new_request_id() -> str:
    return uuid.uuid4().hex


def check_request_id(request_id: str) -> None:
    """Raises InvalidArgument naming the rule when a caller's id breaks it; "" (none given) passes."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id is {len(request_id)} characters; it must be {RULE}")
    if not _ALLOWED.fullmatch(request_id):
        position, char = next((i, c) for i, c in enumerate(request_id) if not "\x21" <= c <= "\x7e")
        raise InvalidArgument(f"request_id has {char!r} at position {position}; it must be {RULE}")


def caller_request_id(request_id: str) -> str:
    """The id to log and echo back: the caller's when it is good, else a new one (the request is then
    refused by check_request_id, and the bad id is never written to a log line)."""
    try:
        check_request_id(request_id)
    except InvalidArgument:
        return new_request_id()
    return request_id or new_request_id()
