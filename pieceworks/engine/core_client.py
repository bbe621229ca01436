"""The front end's clients of an engine loop: in a thread of this process, or in its own process.

``EngineClient`` is what ``AsyncLLMEngine`` (``engine/async_engine.py``) needs of either:
``start`` connects the loop's outputs to the event loop, ``send`` queues a command of
``engine/messages.py``. ``InprocEngineClient`` runs ``EngineCoreLoop`` on a thread of this process
(tests, debugging, ``pieceworks serve --engine-in-process``). ``EngineProcessClient`` (what
``pieceworks serve`` uses) starts ``run_engine_core`` (``engine/core_process.py``) with the
``spawn`` start method (a device runtime cannot be forked, and the server process never
initialises one); the child is not daemonic, so a tensor-parallel engine can spawn its rank
workers.

IPC is two one-way pipes (``multiprocessing.Pipe``). Commands go down as pickled lists, all the
commands of one event-loop iteration in one message, written without blocking the event loop
(a full pipe is finished by a writer callback). Outputs come up as one ``EngineCoreOutputs`` per
engine turn, read by an ``add_reader`` callback on the event loop that unpickles and dispatches.
The server learns of the child's death from end-of-file on the output pipe and fails every live
request with the exit code; ``shutdown`` sends ``Shutdown``, waits for the engine to free itself,
and kills it past a timeout.
"""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing
import os
import queue
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Protocol

from pieceworks.engine.core import EngineCore
from pieceworks.engine.core_loop import EngineCoreLoop
from pieceworks.engine.core_process import (
    EngineBuildFailure,
    EngineInfo,
    EngineSpec,
    run_engine_core,
)
from pieceworks.engine.messages import EngineCommand, EngineCoreOutputs, EngineStats, Shutdown
from pieceworks.logger import init_logger

logger = init_logger(__name__)

# Output messages one reader callback takes (and hands on together) before it yields to the
# event loop.
MAX_MESSAGES_PER_READ = 16
# How long shutdown waits for the engine process to free its engine before killing it.
SHUTDOWN_TIMEOUT_SECONDS = 30.0

# Takes the engine turns that have arrived, in order: one at a time while the front end keeps
# up, several together when it fell behind (their deltas then reach each stream at once).
OutputsHandler = Callable[[list[EngineCoreOutputs]], None]


class RemoteTraceback(Exception):
    """The engine process's traceback, chained under the error it raised (``--debug``)."""


class EngineClient(Protocol):
    """How the front end reaches an engine loop. ``start`` and ``send`` run on the event loop;
    ``on_outputs`` is called on ``loop`` with the turns that have arrived, every turn once, in
    order."""

    max_num_seqs: int
    initial_stats: EngineStats

    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OutputsHandler) -> None: ...

    def send(self, command: EngineCommand) -> None: ...

    def is_alive(self) -> bool: ...

    def shutdown(self, timeout: float | None) -> None: ...


class InprocEngineClient:
    """The engine loop on a thread of this process, fed through a thread-safe queue."""

    def __init__(self, engine_core: EngineCore) -> None:
        self.engine_core = engine_core
        self.core_loop = EngineCoreLoop(engine_core)
        self.max_num_seqs = engine_core.config.scheduler_config.max_num_seqs
        self.initial_stats = self.core_loop.stats()
        self._commands: queue.Queue[EngineCommand] = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OutputsHandler) -> None:
        # Turns wait here until the event loop takes them: one callback takes every turn that
        # arrived before it ran, so a front end that fell behind handles them together, as it
        # does those waiting in the engine process's pipe.
        waiting: list[EngineCoreOutputs] = []
        lock = threading.Lock()

        def dispatch() -> None:
            nonlocal waiting
            with lock:
                turns, waiting = waiting, []
            on_outputs(turns)

        def send(outputs: EngineCoreOutputs) -> None:
            with lock:
                waiting.append(outputs)
                if len(waiting) > 1:  # a callback is already on its way
                    return
            try:
                loop.call_soon_threadsafe(dispatch)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass

        def run() -> None:
            try:
                self.core_loop.run_busy_loop(self._receive, send)
            except BaseException as error:  # the loop is dead: tell the front end why
                logger.exception("engine loop stopped on an error")
                send(EngineCoreOutputs([], None, failure=f"the engine failed: {error!r}"))

        self._thread = threading.Thread(target=run, name="pieceworks-engine", daemon=True)
        self._thread.start()

    def _receive(self, timeout: float) -> list[EngineCommand]:
        try:
            commands = [
                self._commands.get(timeout=timeout) if timeout else self._commands.get_nowait()
            ]
        except queue.Empty:
            return []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def send(self, command: EngineCommand) -> None:
        self._commands.put(command)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float | None) -> None:
        """Stop the loop (requests still live are aborted), then free the engine."""
        self._commands.put(Shutdown())
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine_core.shutdown()


class EngineProcessClient:
    """The server's side of the engine process: start it, send commands, read its outputs."""

    def __init__(self, spec: EngineSpec) -> None:
        context = multiprocessing.get_context("spawn")
        child_commands, self._commands = context.Pipe(duplex=False)
        self._outputs, child_outputs = context.Pipe(duplex=False)
        self.process = context.Process(
            target=run_engine_core,
            args=(spec, child_commands, child_outputs),
            name="pieceworks-engine",
            daemon=False,  # it may start tensor-parallel workers of its own
        )
        self.process.start()
        # Only the child holds these ends now, so its exit is end-of-file on our side.
        child_commands.close()
        child_outputs.close()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[EngineCommand] = []
        self._unsent = bytearray()
        self._closed = False
        self._ready = False
        atexit.register(self.shutdown)
        try:
            self.info = self._wait_until_ready()
        except BaseException:
            self.shutdown()
            raise
        self._ready = True
        self.max_num_seqs = self.info.max_num_seqs
        self.initial_stats = self.info.stats

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def _wait_until_ready(self) -> EngineInfo:
        """The child's ``EngineInfo``, or its construction error raised here."""
        try:
            message: EngineInfo | EngineBuildFailure = self._outputs.recv()
        except EOFError:
            raise RuntimeError(
                f"{self._death()} while building the engine; its log above says why"
            ) from None
        if isinstance(message, EngineBuildFailure):
            raise message.error from RemoteTraceback(message.traceback)
        return message

    def _death(self) -> str:
        self.process.join(1)  # its pipe closed: it is exiting or gone
        code = self.process.exitcode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"was killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        return f"the engine process (pid {self.process.pid}) {how}"

    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: OutputsHandler) -> None:
        self._loop = loop
        os.set_blocking(self._commands.fileno(), False)
        loop.add_reader(self._outputs.fileno(), self._read, on_outputs)
        if self._pending:  # commands sent before the loop was known
            loop.call_soon(self._flush)

    def _read(self, on_outputs: OutputsHandler) -> None:
        """The output messages that have arrived, dispatched together in order (on the event
        loop); at most ``MAX_MESSAGES_PER_READ``, so that other callbacks run between (the
        reader is called again while more wait)."""
        turns: list[EngineCoreOutputs] = []
        try:
            while len(turns) < MAX_MESSAGES_PER_READ and self._outputs.poll():
                turns.append(self._outputs.recv())
        except (EOFError, OSError):
            assert self._loop is not None
            self._loop.remove_reader(self._outputs.fileno())
            if not self._closed:
                reason = f"{self._death()}; restart the server"
                turns.append(EngineCoreOutputs([], None, failure=reason))
        if turns:
            on_outputs(turns)

    def send(self, command: EngineCommand) -> None:
        """Queue a command; the commands of one event-loop iteration go as one message."""
        self._pending.append(command)
        if len(self._pending) == 1 and self._loop is not None:
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        if self._closed or not self._pending:
            return
        data = bytes(ForkingPickler.dumps(self._pending))
        self._pending = []
        was_empty = not self._unsent
        self._unsent += struct.pack("!i", len(data)) + data  # Connection's framing
        if was_empty:
            self._write()

    def _write(self) -> None:
        """Write what the pipe takes now; the rest when it is writable again."""
        assert self._loop is not None
        fd = self._commands.fileno()
        try:
            written = os.write(fd, self._unsent)
        except BlockingIOError:
            written = 0
        except OSError:  # the engine process is gone: the reader reports it
            self._unsent.clear()
            return
        del self._unsent[:written]
        if self._unsent:
            self._loop.add_writer(fd, self._write)
        else:
            self._loop.remove_writer(fd)

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def shutdown(self, timeout: float | None = SHUTDOWN_TIMEOUT_SECONDS) -> None:
        """Tell the engine to stop (what is still live is aborted), wait for it to free its
        engine, kill it past ``timeout``; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self._ready:
            self._send_shutdown()
            self._drain_outputs(timeout)
        if self.process.is_alive():
            if self._ready:
                logger.warning("the engine process did not stop in %s s; killing it", timeout)
            self.process.kill()
            self.process.join(5)
        self._commands.close()
        self._outputs.close()

    def _drain_outputs(self, timeout: float | None) -> None:
        """Read (and drop) the engine's last outputs until it exits, so that a full output pipe
        never keeps it from exiting; at most ``timeout`` seconds."""
        deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
        while self.process.is_alive() and time.monotonic() < deadline:
            try:
                if self._outputs.poll(0.05):
                    self._outputs.recv_bytes()
            except (EOFError, OSError):  # it closed its end: it is exiting
                self.process.join(max(deadline - time.monotonic(), 0))
                return

    def _send_shutdown(self) -> None:
        """Write what is queued and the shutdown command, blocking (the loop may be gone)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._outputs.fileno())
            self._loop.remove_writer(self._commands.fileno())
        data = bytes(ForkingPickler.dumps([*self._pending, Shutdown()]))
        self._unsent += struct.pack("!i", len(data)) + data
        fd = self._commands.fileno()
        try:
            os.set_blocking(fd, True)
            while self._unsent:
                del self._unsent[: os.write(fd, self._unsent)]
        except OSError:  # the engine process is gone already
            pass
