"""The engine loop in a process of its own, and the server's client of it.

``EngineProcessClient(spec)`` starts ``run_engine_core`` with the ``spawn`` start method (a
device runtime cannot be forked, and the server process never initialises one): the child
builds the ``LLMEngine`` (load, compile, KV cache, capture) from the ``EngineSpec`` (``LLM``'s
arguments), reports ``EngineInfo`` (the limits the server checks requests against) or the
exception that stopped construction, then runs ``core.run_engine_loop``. The child is not
daemonic, so a tensor-parallel engine can spawn its rank workers.

IPC is two one-way pipes (``multiprocessing.Pipe``). Commands go down as pickled lists, all the
commands of one event-loop iteration in one message, written without blocking the event loop
(a full pipe is finished by a writer callback). Outputs come up as one ``EngineCoreOutputs`` per
engine turn, read by an ``add_reader`` callback on the event loop that unpickles and dispatches.

Lifetimes: the child ignores SIGINT and SIGTERM (a terminal's Ctrl-C or a service manager
signals the whole process group; the server drains its requests first and then sends
``shutdown``). The child leaves when the command pipe reaches end-of-file (the server went
away), or, while still starting, when the parent process dies. The server learns of the child's
death from end-of-file on the output pipe and fails every live request with the exit code.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import multiprocessing
import os
import pickle
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

from pieceworks.engine.core import (
    Command,
    EngineCore,
    EngineCoreOutputs,
    EngineStats,
    run_engine_loop,
)
from pieceworks.logger import init_logger

logger = init_logger(__name__)

# Output messages one reader callback dispatches before it yields to the event loop.
MAX_MESSAGES_PER_READ = 16
# How long shutdown waits for the engine process to free its engine before killing it.
SHUTDOWN_TIMEOUT_SECONDS = 30.0


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What the engine process builds: the arguments of ``LLM(model, compilation_config, ...)``."""

    model: str
    compilation_config: Any = None
    engine_args: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the engine process reports once its engine is built."""

    pid: int
    max_model_len: int
    vocab_size: int | None
    kv_capacity_tokens: int  # tokens the whole KV cache holds
    max_num_seqs: int
    stats: EngineStats


class RemoteTraceback(Exception):
    """The engine process's traceback, chained under the error it raised (``--debug``)."""


def run_engine_core(spec: EngineSpec, commands: Connection, outputs: Connection) -> None:
    """The engine process: build the engine, report, serve commands until shutdown."""
    # Ignored (inherited by tensor-parallel workers too, which the engine stops itself) ...
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # ... and caught without effect: a handler, unlike SIG_IGN, is not inherited across exec, so
    # the workers keep SIGTERM and ``Process.terminate()`` still stops one that hangs.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    started = threading.Event()
    _exit_if_parent_dies_before(started)
    try:
        engine = _build_engine(spec)
    except BaseException as error:
        outputs.send(("error", _portable(error), traceback.format_exc()))
        sys.exit(1)
    started.set()
    core = EngineCore(engine)
    outputs.send(("ready", _engine_info(engine, core)))
    send = _sender(outputs)
    try:
        run_engine_loop_until_eof(core, commands, send)
    except BaseException as error:
        logger.exception("engine loop stopped on an error")
        send(EngineCoreOutputs([], None, failure=f"the engine failed: {error!r}"))
        engine.shutdown()
        sys.exit(1)
    engine.shutdown()


def _build_engine(spec: EngineSpec) -> Any:
    from pieceworks.engine.arg_utils import build_engine_config
    from pieceworks.engine.llm_engine import LLMEngine

    return LLMEngine(build_engine_config(spec.model, spec.compilation_config, **spec.engine_args))


def _engine_info(engine: Any, core: EngineCore) -> EngineInfo:
    config = engine.config
    return EngineInfo(
        pid=os.getpid(),
        max_model_len=config.model_config.max_model_len,
        vocab_size=config.model_config.hf_config.get("vocab_size"),
        kv_capacity_tokens=engine.scheduler.block_manager.num_tokens_capacity,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        stats=core.stats(),
    )


def run_engine_loop_until_eof(
    core: EngineCore, commands: Connection, send: Callable[[EngineCoreOutputs], None]
) -> None:
    """``run_engine_loop`` over the command pipe; its end-of-file is a shutdown."""

    def receive(timeout: float) -> list[Command]:
        batch: list[Command] = []
        try:
            ready = commands.poll(timeout)
            while ready:
                batch.extend(commands.recv())
                ready = commands.poll(0)
        except (EOFError, OSError):  # the server went away
            batch.append(("shutdown",))
        return batch

    run_engine_loop(core, receive, send)


def _sender(outputs: Connection) -> Callable[[EngineCoreOutputs], None]:
    def send(message: EngineCoreOutputs) -> None:
        try:  # pickle's own protocol: a little faster than Connection.send's ForkingPickler
            outputs.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server went away; the next receive sees end-of-file and shuts down

    return send


def _exit_if_parent_dies_before(started: threading.Event) -> None:
    """While the engine is being built nothing reads the command pipe: watch the parent."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        if not started.is_set():
            os._exit(1)

    threading.Thread(target=watch, name="pieceworks-parent-watch", daemon=True).start()


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling, else a RuntimeError with its message."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(str(error) or type(error).__name__)
    return error


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
        self._pending: list[Command] = []
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
            kind, *payload = self._outputs.recv()
        except EOFError:
            raise RuntimeError(
                f"{self._death()} while building the engine; its log above says why"
            ) from None
        if kind == "error":
            error, trace = payload
            raise error from RemoteTraceback(trace)
        return payload[0]

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

    def start(self, loop: asyncio.AbstractEventLoop, on_outputs: Any) -> None:
        self._loop = loop
        os.set_blocking(self._commands.fileno(), False)
        loop.add_reader(self._outputs.fileno(), self._read, on_outputs)
        if self._pending:  # commands sent before the loop was known
            loop.call_soon(self._flush)

    def _read(self, on_outputs: Any) -> None:
        """The output messages that have arrived, dispatched in order (on the event loop); at
        most ``MAX_MESSAGES_PER_READ``, so that other callbacks run between (the reader is
        called again while more wait)."""
        try:
            for _ in range(MAX_MESSAGES_PER_READ):
                if not self._outputs.poll():
                    return
                on_outputs(self._outputs.recv())
        except (EOFError, OSError):
            assert self._loop is not None
            self._loop.remove_reader(self._outputs.fileno())
            if not self._closed:
                reason = f"{self._death()}; restart the server"
                on_outputs(EngineCoreOutputs([], None, failure=reason))

    def send(self, command: Command) -> None:
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
        data = bytes(ForkingPickler.dumps([*self._pending, ("shutdown",)]))
        self._unsent += struct.pack("!i", len(data)) + data
        fd = self._commands.fileno()
        try:
            os.set_blocking(fd, True)
            while self._unsent:
                del self._unsent[: os.write(fd, self._unsent)]
        except OSError:  # the engine process is gone already
            pass
