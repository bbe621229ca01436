"""The engine process: ``EngineCoreLoop`` over an ``EngineCore`` in a process of its own.

``run_engine_core`` is the target that ``EngineProcessClient`` (``engine/core_client.py``)
starts with the ``spawn`` method: it builds the ``EngineCore`` (load, compile, KV cache,
capture) from the ``EngineSpec`` (``LLM``'s arguments), reports ``EngineInfo`` (the limits the
server checks requests against) or an ``EngineBuildFailure`` with the exception that stopped
construction, then runs ``EngineCoreLoop.run_busy_loop`` over two one-way pipes: commands
(``engine/messages.py``) come down in pickled lists, one ``EngineCoreOutputs`` per turn goes up.

Lifetimes: the process ignores SIGINT and SIGTERM (a terminal's Ctrl-C or a service manager
signals the whole process group; the server drains its requests first and then sends
``Shutdown``). It leaves when the command pipe reaches end-of-file (the server went away), or,
while still starting, when the parent process dies (a watchdog thread).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from pieceworks.engine.arg_utils import build_engine_config
from pieceworks.engine.core import EngineCore
from pieceworks.engine.core_loop import EngineCoreLoop
from pieceworks.engine.messages import EngineCommand, EngineCoreOutputs, EngineStats, Shutdown
from pieceworks.logger import init_logger

logger = init_logger(__name__)


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


@dataclasses.dataclass(frozen=True)
class EngineBuildFailure:
    """What the engine process reports when its engine could not be built: the error (or a
    RuntimeError with its message, when the error does not pickle) and its traceback."""

    error: BaseException
    traceback: str


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
        outputs.send(EngineBuildFailure(_portable(error), traceback.format_exc()))
        sys.exit(1)
    started.set()
    loop = EngineCoreLoop(engine)
    outputs.send(_engine_info(engine, loop))
    send = _sender(outputs)
    try:
        run_busy_loop_until_eof(loop, commands, send)
    except BaseException as error:
        logger.exception("engine loop stopped on an error")
        send(EngineCoreOutputs([], None, failure=f"the engine failed: {error!r}"))
        engine.shutdown()
        sys.exit(1)
    engine.shutdown()


def _build_engine(spec: EngineSpec) -> EngineCore:
    return EngineCore(build_engine_config(spec.model, spec.compilation_config, **spec.engine_args))


def _engine_info(engine: EngineCore, loop: EngineCoreLoop) -> EngineInfo:
    config = engine.config
    max_model_len = config.model_config.max_model_len
    assert max_model_len is not None  # the engine's constructor resolved it
    return EngineInfo(
        pid=os.getpid(),
        max_model_len=max_model_len,
        vocab_size=config.model_config.hf_config.get("vocab_size"),
        kv_capacity_tokens=engine.scheduler.block_manager.num_tokens_capacity,
        max_num_seqs=config.scheduler_config.max_num_seqs,
        stats=loop.stats(),
    )


def run_busy_loop_until_eof(
    loop: EngineCoreLoop, commands: Connection, send: Callable[[EngineCoreOutputs], None]
) -> None:
    """``loop.run_busy_loop`` over the command pipe; its end-of-file is a ``Shutdown``."""

    def receive(timeout: float) -> list[EngineCommand]:
        batch: list[EngineCommand] = []
        try:
            ready = commands.poll(timeout)
            while ready:
                batch.extend(commands.recv())
                ready = commands.poll(0)
        except (EOFError, OSError):  # the server went away
            batch.append(Shutdown())
        return batch

    loop.run_busy_loop(receive, send)


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
