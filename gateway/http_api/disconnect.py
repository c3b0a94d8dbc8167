"""A non-streaming response's work, cancelled when its client goes away before the body is written."""
from __future__ import annotations

import asyncio

from fastapi import Request


async def until_disconnect(request: Request, work) -> bool:
    """Run `work` to its end (True), or cancel it when the client goes away first (False).

    A streaming response notices a vanished client when a write fails; a non-streaming one writes
    nothing until the end, so it listens for the disconnect instead.
    """
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - cannot listen: let the work finish as it would have
            await asyncio.Event().wait()

    listener = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        if listener.done() and not listener.cancelled():
            return False
        raise
    return True
