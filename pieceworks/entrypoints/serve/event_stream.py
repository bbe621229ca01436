"""``EventStream``: a streamed response of server-sent events, written straight to the server.

A stream sends one write per engine turn that brought it something, so what each write costs is
paid per streamed token. ``EventStream`` writes from the end of the engine turn itself: its
source (``EventSource``, a ``ChunkStream`` in ``serving.py``) calls it back once the turn's text
is in, and it takes the source's write and hands it to the server's ``send`` there, driving that
coroutine by hand: a write the server takes at once (the socket's buffer has room) finishes
inside the call, with no task, future or wake-up per stream and turn. A write the server holds
back (it paused writing for a client that reads slowly) goes on in a task of its own, which
then takes what piled up meanwhile as one write, and so on until the stream has caught up; the
turns in between skip this stream, so a slow client never holds up the others, and loses
nothing (its tokens wait, merged, in the generation).

Starlette's ``StreamingResponse`` runs every write through a task group and the ``send``
wrappers of its middleware (each only watches for the response's start, then passes the message
on); ``EventStream`` sends its start through the app's ``send`` (so the middleware knows the
response started and never sends an error page after it) and its body through the server's own
``send``, which ``RequestGuard`` (the outermost layer) puts in the scope under ``SERVER_SEND``.

The response's task waits on one future, ``_done``, which the stream's last write, a write that
failed (its exception, raised by the task) or ``http.disconnect`` (a client that went away, seen
by a watcher task) settles, whichever comes first; either way the source is closed, which aborts
what still runs.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Callable, Coroutine, Generator, Mapping
from typing import Any, Protocol

from starlette.responses import Response

SERVER_SEND = "pieceworks.server_send"  # the scope key of the server's own ``send``


class EventSource(Protocol):
    """What an ``EventStream`` writes: ``take`` the next write (``b""`` when nothing is ready;
    ``ended`` once the last was taken), ``listen`` for what becomes ready, ``aclose`` at the end."""

    ended: bool

    def take(self) -> bytes: ...

    def listen(self, on_ready: Callable[[], None] | None) -> None: ...

    async def aclose(self) -> None: ...


class EventStream(Response):
    """``text/event-stream`` from an ``EventSource``; the source is always closed."""

    media_type = "text/event-stream"

    def __init__(self, source: EventSource, headers: Mapping[str, str]) -> None:
        self.source = source
        self.status_code = 200
        self.background = None
        self.init_headers(headers)
        self._behind: asyncio.Task[None] | None = None  # finishes a held-back write, catches up
        self._closed = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        self._send = scope.get(SERVER_SEND, send)
        done = self._done = asyncio.get_running_loop().create_future()
        # One task for the disconnect, which ends the response through ``_done`` like the last
        # write does; the response's task waits on ``_done`` alone.
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            self.write()  # what is there already (the first chunks)
            self.source.listen(self.write)
            await done
        finally:
            self._closed = True
            self.source.listen(None)
            watcher.cancel()  # it holds nothing: it only ever waits on ``receive``
            behind = self._behind
            if behind is not None:  # a write held back: it goes no further
                behind.cancel()
                await asyncio.gather(behind, return_exceptions=True)
            await self.source.aclose()

    async def _watch(self, receive: Any) -> None:
        """End the response when the client disconnects (or ``receive`` fails)."""
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: S110 - nobody left to answer: the response just ends
            pass
        self._end()

    def write(self) -> None:
        """Send what the source has ready, now (the end of an engine turn), unless a write held
        back by the server is still going: then its task takes this too, later."""
        if self._closed or self._behind is not None:
            return
        source = self.source
        try:
            body = source.take()
            if not body and not source.ended:
                return
            coroutine = self._send_body(body)
            try:
                suspended = coroutine.send(None)
            except StopIteration:
                if source.ended:
                    self._end()
                return
            self._behind = asyncio.ensure_future(self._catch_up(coroutine, suspended))
        except BaseException as error:  # a bug or a broken server: the response's task raises it
            self._fail(error)

    def _send_body(self, body: bytes) -> Coroutine[Any, Any, None]:
        more_body = not self.source.ended  # the last write also ends the response
        return self._send({"type": "http.response.body", "body": body, "more_body": more_body})

    def _end(self) -> None:
        self._closed = True  # nothing is written after the last write
        if not self._done.done():
            self._done.set_result(None)

    async def _catch_up(self, coroutine: Coroutine[Any, Any, None], suspended: Any) -> None:
        """Finish a write the server held back, then send what piled up meanwhile (one write
        each time round) until nothing is left; then the engine turns write again."""
        try:
            await _resume(coroutine, suspended)
            while not self.source.ended:
                body = self.source.take()
                if not body and not self.source.ended:
                    break
                await self._send_body(body)
            if self.source.ended:
                self._end()
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            self._fail(error)
        finally:
            self._behind = None

    def _fail(self, error: BaseException) -> None:
        self._closed = True
        if not self._done.done():
            self._done.set_exception(error)


@types.coroutine
def _resume(coroutine: Coroutine[Any, Any, None], suspended: Any) -> Generator[Any, Any, None]:
    """The rest of ``coroutine``, which was first run by hand and suspended on ``suspended``
    (a future, or None for a bare yield): the awaiting task waits on it, then runs the rest."""
    try:
        yield suspended
    except BaseException:
        coroutine.close()
        raise
    yield from coroutine  # type: ignore[misc]
