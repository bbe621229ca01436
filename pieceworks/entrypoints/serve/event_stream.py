"""``EventStream``: a streamed response of server-sent events, written straight to the server.

A stream sends one write per wake of its reader, up to one per engine turn, so what each write
costs is paid per streamed token. Starlette's ``StreamingResponse`` runs every write through a
task group and the ``send`` wrappers of its middleware (each only watches for the response's
start, then passes the message on); ``EventStream`` sends its start through the app's ``send``
(so the middleware knows the response started and never sends an error page after it) and its
body through the server's own ``send``, which ``RequestGuard`` (the outermost layer) puts in the
scope under ``SERVER_SEND``.

A client that disconnects cancels the stream at once: the writing runs as a task beside one that
waits for ``http.disconnect`` (two tasks per response, none per write), and whichever ends
first cancels the other; closing the events then aborts the generation's engine requests. The
events come as ``bytes``, one write each.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.responses import Response

SERVER_SEND = "pieceworks.server_send"  # the scope key of the server's own ``send``


class EventStream(Response):
    """``text/event-stream`` from an async iterator of ``bytes``; the iterator is always closed."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: Mapping[str, str]) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        writer = asyncio.ensure_future(self._write(scope.get(SERVER_SEND, send)))
        watcher = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, watcher):
                task.cancel()
            await asyncio.gather(writer, watcher, return_exceptions=True)
            await self.events.aclose()  # type: ignore[attr-defined]
        if not writer.cancelled() and writer.exception() is not None:
            raise writer.exception()  # type: ignore[misc]

    async def _write(self, send: Any) -> None:
        async for body in self.events:
            await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
