"""``EventStream`` writing from the engine turn, over a fake source and a fake server ``send``.

Proves: a write the server takes at once goes out inside the turn's call (no task); a write the
server holds back (a client that reads slowly) does not stop later turns from returning at once,
and once it goes out, what piled up meanwhile follows as one write, nothing lost, then the turns
write directly again; the last write ends the response; a client that disconnects mid-stream
ends the response at once and closes the source (which aborts the generation), before any write
too; a write that fails raises from the response, the source closed.
Run: pytest tests/entrypoints/test_serve_event_stream.py -q
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("starlette")

from pieceworks.entrypoints.serve.event_stream import SERVER_SEND, EventStream  # noqa: E402


class FakeSource:
    """Pieces the test makes ready; ``take`` joins them; ``finish`` makes the next the last."""

    def __init__(self) -> None:
        self.ready: list[bytes] = []
        self.ended = False
        self.finishing = False
        self.closed = False
        self.on_ready = None

    def add(self, piece: bytes, last: bool = False) -> None:
        self.ready.append(piece)
        self.finishing = self.finishing or last
        if self.on_ready is not None:
            self.on_ready()  # the end of the engine turn that brought it

    def take(self) -> bytes:
        body, self.ready = b"".join(self.ready), []
        self.ended = self.finishing
        return body

    def listen(self, on_ready) -> None:
        self.on_ready = on_ready

    async def aclose(self) -> None:
        self.closed = True


class FakeServer:
    """The server's ``send``: records bodies; while ``hold`` is set, a body waits for it."""

    def __init__(self) -> None:
        self.bodies: list[tuple[bytes, bool]] = []
        self.hold: asyncio.Future[None] | None = None
        self.disconnect = asyncio.Event()

    async def send(self, message) -> None:
        if message["type"] == "http.response.body":
            if self.hold is not None:
                await self.hold
            self.bodies.append((message["body"], message["more_body"]))

    async def receive(self):
        await self.disconnect.wait()
        return {"type": "http.disconnect"}


async def _start(source: FakeSource, server: FakeServer) -> asyncio.Task[None]:
    stream = EventStream(source, headers={})  # type: ignore[arg-type]
    task = asyncio.ensure_future(stream({SERVER_SEND: server.send}, server.receive, server.send))
    await asyncio.sleep(0)
    return task


def test_a_slow_reader_catches_up_in_one_write_without_holding_up_the_turns():
    async def run() -> tuple[list[tuple[bytes, bool]], bool]:
        source, server = FakeSource(), FakeServer()
        response = await _start(source, server)
        source.add(b"a")
        assert server.bodies == [(b"a", True)]  # written inside the turn's call
        server.hold = asyncio.get_running_loop().create_future()
        source.add(b"b")  # held back by the server
        source.add(b"c")  # these turns return at once, their pieces wait
        source.add(b"d")
        assert server.bodies == [(b"a", True)]
        hold, server.hold = server.hold, None
        hold.set_result(None)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert server.bodies == [(b"a", True), (b"b", True), (b"cd", True)]
        source.add(b"e", last=True)  # direct again; the last write ends the response
        await asyncio.wait_for(response, 5)
        return server.bodies, source.closed

    bodies, closed = asyncio.run(run())
    assert bodies[-1] == (b"e", False) and closed


def test_a_disconnect_mid_stream_ends_the_response_and_closes_the_source():
    async def run() -> tuple[list[tuple[bytes, bool]], bool]:
        source, server = FakeSource(), FakeServer()
        response = await _start(source, server)
        source.add(b"a")
        server.hold = asyncio.get_running_loop().create_future()
        source.add(b"b")  # a write in flight when the client leaves
        server.disconnect.set()
        await asyncio.wait_for(response, 5)
        source.add(b"c")  # a turn after the end writes nothing
        return server.bodies, source.closed

    bodies, closed = asyncio.run(run())
    assert bodies == [(b"a", True)] and closed


def test_a_disconnect_before_any_write_ends_the_response_at_once():
    async def run() -> bool:
        source, server = FakeSource(), FakeServer()
        response = await _start(source, server)
        server.disconnect.set()
        await asyncio.wait_for(response, 5)
        return source.closed

    assert asyncio.run(run())


def test_a_write_that_fails_raises_from_the_response_and_closes_the_source():
    class Broken(FakeServer):
        async def send(self, message) -> None:
            if message["type"] == "http.response.body":
                raise OSError("broken pipe")

    async def run() -> FakeSource:
        source, server = FakeSource(), Broken()
        response = await _start(source, server)
        source.add(b"a")
        with pytest.raises(OSError, match="broken pipe"):
            await asyncio.wait_for(response, 5)
        return source

    assert asyncio.run(run()).closed
