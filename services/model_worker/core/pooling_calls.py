"""The engine client's open pooling calls (Embed, Score): each input a request on the core, a call answered once
every input is, or failed by the first error of any."""
from __future__ import annotations

import asyncio

from rpcserver.errors import ServiceError, Unavailable
from services.model_worker.engine.pooling import PoolingOutput


class PoolingCall:
    """One call's inputs: their outputs by input index, and the future its caller awaits."""

    def __init__(self, count: int):
        self.results: list[PoolingOutput | None] = [None] * count
        self.missing = count
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.core_ids: list[str] = []  # its inputs' ids on the core, by input index


class PoolingCalls:
    """Every open pooling call's inputs, by their id on the serving core."""

    def __init__(self):
        self._by_core_id: dict[str, tuple[PoolingCall, int]] = {}
        self._calls: set[PoolingCall] = set()  # placed and not yet closed

    def __len__(self) -> int:
        """Inputs on the core."""
        return len(self._by_core_id)

    @property
    def num_calls(self) -> int:
        """Calls open: placed and not yet closed by their caller."""
        return len(self._calls)

    def place(self, call: PoolingCall, core_id: str) -> None:
        """The call's next input runs on the core under core_id."""
        self._by_core_id[core_id] = (call, len(call.core_ids))
        self._calls.add(call)
        call.core_ids.append(core_id)

    def deliver(self, output: PoolingOutput) -> bool:
        """An input's output (under its core id); False when no open call awaits it (cancelled or failed)."""
        entry = self._by_core_id.pop(output.request_id, None)
        if entry is None:
            return False
        call, index = entry
        call.results[index] = output
        call.missing -= 1
        if not call.missing and not call.future.done():
            call.future.set_result(call.results)
        return True

    def fail(self, core_id: str, error: ServiceError) -> bool:
        """An input failed: its whole call fails with that error (its other inputs run until the caller closes
        it); False when no open call has it."""
        entry = self._by_core_id.pop(core_id, None)
        if entry is None:
            return False
        _settle(entry[0], error)
        return True

    def fail_all(self, message: str) -> None:
        """The core is gone, and every input with it: each open call fails Unavailable (an embedding call is
        short, so none is carried on to the next core)."""
        entries, self._by_core_id = self._by_core_id, {}
        self._calls.clear()
        for call, _ in entries.values():
            _settle(call, Unavailable(message))

    def close(self, call: PoolingCall) -> list[str]:
        """Forget a call that ended or was cancelled; returns the core ids of its inputs still running there."""
        self._calls.discard(call)
        return [core_id for core_id in call.core_ids if self._by_core_id.pop(core_id, None) is not None]


def _settle(call: PoolingCall, error: ServiceError) -> None:
    if not call.future.done():
        call.future.set_exception(error)
