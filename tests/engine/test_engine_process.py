"""The engine process and its client, run in this process: the "process" is a thread.

``EngineProcessClient`` starts ``run_engine_core`` through a ``spawn`` context; here the context's
``Process`` is a stand-in that runs the target on a thread, with its own copies of the pipe ends
(as a spawned child has) that it closes when the target returns (as a child's exit does), and
``core_process.signal`` is a recorder (only the main thread may set handlers). Everything else
is real: pipes, pickling and framing, ``EngineCoreLoop`` over llama-tiny at level 0 on CPU, float32.

Proves: the engine process ignores SIGINT and catches SIGTERM without effect; it builds the
``EngineSpec``'s engine and reports its ``EngineInfo`` (pid, limits, KV capacity, stats); commands
sent before and after ``start`` reach it, a command larger than the pipe is finished by the writer
callback, and a request streams the offline greedy tokens; a refused prompt comes back as its error
delta; ``shutdown`` ends the loop, aborts a live request (its KV blocks come back), shuts the
engine down, kills nothing and closes both pipes, once; an engine spec that fails is raised in the
client as its own error over the ``RemoteTraceback``; a child that dies while starting is reported
with its exit status; a message the loop cannot apply fails the engine with that error, the loop
shuts the engine down and exits with status 1, and the client then reports the death; the parent
watch exits only while the engine is still being built; an engine loop whose command pipe ends
aborts its live requests; a send to a server that went away is dropped; ``shutdown`` writes the
commands still queued with ``shutdown`` in one message and kills an engine that does not stop in
``timeout``; one read dispatches at most ``MAX_MESSAGES_PER_READ`` messages, in order, in one
call.
Run: pytest tests/engine/test_engine_process.py
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
import types
from multiprocessing.connection import Connection

import pytest

from pieceworks.engine import core_client, core_process
from pieceworks.engine.core_client import EngineProcessClient, RemoteTraceback
from pieceworks.engine.core_loop import EngineCoreLoop
from pieceworks.engine.core_process import EngineSpec, run_busy_loop_until_eof
from pieceworks.engine.llm import LLM
from pieceworks.engine.messages import AddRequest, EngineCoreOutputs, Shutdown
from pieceworks.models.loading.sources import ModelSourceError
from pieceworks.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
PROMPT = [3, 14, 15, 92]
SPEC = EngineSpec("llama-tiny", {"level": 0}, {"dtype": "float32", "max_num_seqs": 2})
CHILD_PID = 4242  # the stand-in process's pid


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("llama-tiny", compilation_config={"level": 0}, dtype="float32", max_num_seqs=2)


@pytest.fixture(scope="module")
def offline(llm) -> list[int]:
    return llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def own_copy(arg):
    """A pipe end of the child's own (its fd duplicated, as passing it to a child does)."""
    return Connection(os.dup(arg.fileno())) if isinstance(arg, Connection) else arg


class ThreadProcess:
    """``multiprocessing.Process`` as a thread: own pipe ends, closed when the target returns."""

    started: list[ThreadProcess] = []

    def __init__(self, target, args, name, daemon) -> None:
        self.name, self.daemon, self.pid = name, daemon, CHILD_PID
        self.exitcode: int | None = None
        self.killed = False
        self._target = target
        self._args = [own_copy(arg) for arg in args]
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self._target(*self._args)
            self.exitcode = 0
        except SystemExit as exit_:
            self.exitcode = exit_.code if isinstance(exit_.code, int) else 1
        finally:
            for arg in self._args:
                if isinstance(arg, Connection):
                    arg.close()

    def start(self) -> None:
        ThreadProcess.started.append(self)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout=None) -> None:
        self._thread.join(timeout)

    def kill(self) -> None:
        self.killed = True
        self._thread.join(10)


class SignalRecorder:
    SIGINT, SIGTERM, SIG_IGN = signal.SIGINT, signal.SIGTERM, signal.SIG_IGN

    def __init__(self) -> None:
        self.handlers: dict[int, object] = {}

    def signal(self, signum, handler) -> None:
        self.handlers[signum] = handler


@pytest.fixture
def threads(monkeypatch):
    """The spawn context's processes run as threads; returns the signal recorder."""
    contexts = []
    real_get_context = multiprocessing.get_context

    def get_context(method):
        contexts.append(method)
        real = real_get_context(method)
        return types.SimpleNamespace(Pipe=real.Pipe, Process=ThreadProcess)

    recorder = SignalRecorder()
    monkeypatch.setattr(core_client.multiprocessing, "get_context", get_context)
    monkeypatch.setattr(core_process, "signal", recorder)
    ThreadProcess.started = []
    yield recorder
    assert contexts == ["spawn"] * len(contexts)


@pytest.fixture
def engines(monkeypatch):
    """The engines the engine process builds, in order."""
    built = []
    real_build = core_process._build_engine

    def build(spec):
        built.append(real_build(spec))
        return built[-1]

    monkeypatch.setattr(core_process, "_build_engine", build)
    return built


class Outputs:
    """The client's ``on_outputs``: every message, and an event when ``until`` holds."""

    def __init__(self, loop: asyncio.AbstractEventLoop, until) -> None:
        self.messages: list[EngineCoreOutputs] = []
        self.done = loop.create_future()
        self._until = until

    def __call__(self, messages: list[EngineCoreOutputs]) -> None:
        self.messages.extend(messages)
        if not self.done.done() and self._until(self.messages):
            self.done.set_result(None)

    def deltas(self, request_id: str):
        return [d for m in self.messages for d in m.deltas if d.request_id == request_id]


def finished(request_id: str):
    return lambda messages: any(
        d.request_id == request_id and d.finished for m in messages for d in m.deltas
    )


def serve(client: EngineProcessClient, until, commands_before=(), commands_after=()) -> Outputs:
    """Start the client on a fresh event loop, send the commands, run until ``until``."""
    loop = asyncio.new_event_loop()
    try:
        outputs = Outputs(loop, until)
        for command in commands_before:
            client.send(command)
        client.start(loop, outputs)
        for command in commands_after:
            client.send(command)
        loop.run_until_complete(asyncio.wait_for(outputs.done, 20))
    finally:
        loop.close()
    return outputs


def test_the_engine_process_serves_requests_and_shuts_down(threads, engines, offline):
    client = EngineProcessClient(SPEC)
    (process,) = ThreadProcess.started
    assert (process.name, process.daemon, client.pid) == ("pieceworks-engine", False, CHILD_PID)
    assert threads.handlers[signal.SIGINT] is signal.SIG_IGN
    on_term = threads.handlers[signal.SIGTERM]
    assert on_term not in (signal.SIG_IGN, signal.SIG_DFL) and on_term(signal.SIGTERM, None) is None
    (engine,) = engines
    config = engine.config
    assert (config.model_config.model, config.compilation_config.level) == ("llama-tiny", 0)
    info = client.info
    assert info.pid == os.getpid()  # the engine "process" is this one
    assert (info.max_model_len, info.vocab_size, info.max_num_seqs) == (2048, 256, 2)
    assert info.kv_capacity_tokens == engine.scheduler.block_manager.num_tokens_capacity
    assert client.max_num_seqs == 2 and client.initial_stats is info.stats
    num_blocks = engine.scheduler.block_manager.num_blocks
    assert (info.stats.num_blocks, info.stats.num_free_blocks) == (num_blocks, num_blocks)
    assert info.stats.num_steps == 0 and client.is_alive()

    too_big = [300] * 50_000  # ~100 kB pickled: more than the pipe takes at once
    outputs = serve(
        client,
        lambda messages: finished("a")(messages) and finished("big")(messages),
        commands_before=[AddRequest("a", PROMPT, GREEDY)],
        commands_after=[AddRequest("big", too_big, GREEDY)],
    )
    assert [t for d in outputs.deltas("a") for t in d.new_token_ids] == offline
    assert outputs.deltas("a")[-1].finish_reason == "length"
    (refused,) = outputs.deltas("big")
    assert refused.error == "prompt token ids must be in [0, 256) for this model"
    assert outputs.messages[-1].stats.num_steps >= len(offline)

    client.shutdown(timeout=10)
    assert not client.is_alive() and process.exitcode == 0 and not process.killed
    assert engine.is_shut_down
    assert client._commands.closed and client._outputs.closed
    client.shutdown(timeout=10)  # idempotent


def test_a_live_request_is_aborted_when_the_server_shuts_down(threads, engines):
    client = EngineProcessClient(SPEC)
    outputs = serve(client, lambda m: any(x.deltas for x in m), [AddRequest("long", PROMPT, LONG)])
    assert outputs.deltas("long")[0].new_token_ids
    client.shutdown(timeout=10)
    (engine,) = engines
    assert engine.is_shut_down and not client.is_alive()
    assert (
        engine.scheduler.block_manager.num_free_blocks == engine.scheduler.block_manager.num_blocks
    )
    assert ThreadProcess.started[0].exitcode == 0 and not ThreadProcess.started[0].killed


def test_an_engine_that_cannot_be_built_raises_its_error_in_the_client(threads):
    with pytest.raises(ModelSourceError) as error:
        EngineProcessClient(EngineSpec("no-such-model"))
    assert str(error.value).startswith("model 'no-such-model' is neither a preset (")
    cause = error.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert str(cause).startswith("Traceback (most recent call last):")
    assert "ModelSourceError: model 'no-such-model'" in str(cause)
    (process,) = ThreadProcess.started
    assert process.exitcode == 1 and not process.is_alive()


def test_a_child_that_dies_while_starting_is_reported_with_its_status(threads, monkeypatch):
    def dies(spec, commands, outputs):
        raise SystemExit(3)

    monkeypatch.setattr(core_client, "run_engine_core", dies)
    with pytest.raises(RuntimeError) as error:
        EngineProcessClient(SPEC)
    assert str(error.value) == (
        f"the engine process (pid {CHILD_PID}) exited with status 3 while building the engine; "
        "its log above says why"
    )
    assert error.value.__cause__ is None and not ThreadProcess.started[0].killed


@pytest.mark.parametrize(
    ("exitcode", "how"),
    [(None, "closed its pipe"), (-9, "was killed by signal 9"), (2, "exited with status 2")],
)
def test_the_death_names_the_exit_code(exitcode, how):
    client = EngineProcessClient.__new__(EngineProcessClient)
    client.process = types.SimpleNamespace(pid=7, exitcode=exitcode, join=lambda timeout: None)
    assert client._death() == f"the engine process (pid 7) {how}"


def test_a_command_the_loop_cannot_apply_fails_the_engine(threads, engines):
    client = EngineProcessClient(SPEC)
    outputs = serve(client, lambda m: len(m) >= 2 and m[-1].failure is not None, ["bogus"])
    failures = [m.failure for m in outputs.messages]
    assert failures == [
        "the engine failed: ValueError(\"unknown engine command 'bogus'\")",
        f"the engine process (pid {CHILD_PID}) exited with status 1; restart the server",
    ]
    assert [m.deltas for m in outputs.messages] == [[], []]
    assert outputs.messages[0].stats is None
    (engine,) = engines
    assert engine.is_shut_down and ThreadProcess.started[0].exitcode == 1
    client.shutdown(timeout=10)
    assert not ThreadProcess.started[0].killed


def watches() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pieceworks-parent-watch"]


def test_the_parent_watch_exits_only_while_the_engine_is_being_built(monkeypatch):
    exits: list[int] = []
    monkeypatch.setattr(core_process.os, "_exit", exits.append)
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: None)
    core_process._exit_if_parent_dies_before(threading.Event())
    assert watches() == []  # no parent, no watch
    for built, expected in [(False, [1]), (True, [])]:
        parent_end, watch_end = multiprocessing.Pipe()
        parent = types.SimpleNamespace(sentinel=watch_end)
        monkeypatch.setattr(multiprocessing, "parent_process", lambda parent=parent: parent)
        started = threading.Event()
        core_process._exit_if_parent_dies_before(started)
        (watch,) = watches()
        assert watch.daemon
        if built:
            started.set()
        parent_end.close()  # the parent died
        watch.join(5)
        assert not watch.is_alive() and exits == expected
        exits.clear()
        watch_end.close()


def test_an_engine_loop_whose_command_pipe_ends_aborts_its_requests(llm):
    commands, server_end = multiprocessing.Pipe(duplex=False)
    server_end.send([AddRequest("a", PROMPT, LONG)])
    server_end.send([AddRequest("b", PROMPT, LONG)])
    server_end.close()  # the server went away
    sent: list[EngineCoreOutputs] = []
    run_busy_loop_until_eof(EngineCoreLoop(llm.engine), commands, sent.append)
    (last,) = sent
    assert [(d.request_id, d.finish_reason, d.new_token_ids) for d in last.deltas] == [
        ("a", "abort", []),
        ("b", "abort", []),
    ]
    assert last.stats.num_aborted == 2 and last.stats.num_steps == 0
    assert not llm.engine.has_unfinished_requests()
    commands.close()


def test_outputs_arrive_whole_and_a_send_after_the_server_left_is_dropped(llm):
    server_end, engine_end = multiprocessing.Pipe(duplex=False)
    send = core_process._sender(engine_end)
    message = EngineCoreLoop(llm.engine).take_outputs()
    send(message)
    assert server_end.recv() == message
    server_end.close()
    send(message)  # BrokenPipeError, dropped
    engine_end.close()


class HungProcess:
    """An engine process that never exits until it is killed."""

    pid, exitcode = CHILD_PID, None

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def is_alive(self) -> bool:
        return ("kill",) not in self.calls

    def kill(self) -> None:
        self.calls.append(("kill",))

    def join(self, timeout=None) -> None:
        self.calls.append(("join", timeout))


def test_shutdown_sends_what_is_queued_then_kills_an_engine_that_does_not_stop():
    client = EngineProcessClient.__new__(EngineProcessClient)
    engine_commands, client._commands = multiprocessing.Pipe(duplex=False)
    client._outputs, engine_outputs = multiprocessing.Pipe(duplex=False)
    client.process = HungProcess()
    client._loop, client._pending, client._unsent = None, [], bytearray()
    client._closed, client._ready = False, True
    client.send(AddRequest("a", PROMPT, GREEDY))  # no loop yet: queued
    engine_outputs.send_bytes(b"a last output, dropped")
    start = time.monotonic()
    client.shutdown(timeout=0.2)
    assert time.monotonic() - start >= 0.2
    assert client.process.calls == [("kill",), ("join", 5)]
    assert engine_commands.recv() == [AddRequest("a", PROMPT, GREEDY), Shutdown()]
    assert client._commands.closed and client._outputs.closed
    engine_commands.close()
    engine_outputs.close()


def test_one_read_dispatches_at_most_max_messages_per_read():
    client = EngineProcessClient.__new__(EngineProcessClient)
    client._outputs, engine_outputs = multiprocessing.Pipe(duplex=False)
    send = core_process._sender(engine_outputs)
    for num_steps in range(core_client.MAX_MESSAGES_PER_READ + 4):
        send(EngineCoreOutputs([], None, failure=str(num_steps)))
    reads: list[list[EngineCoreOutputs]] = []
    client._read(reads.append)  # the turns that arrived, together
    assert [[m.failure for m in read] for read in reads] == [[str(i) for i in range(16)]]
    client._read(reads.append)  # the reader is called again while more wait
    assert [m.failure for m in reads[1]] == [str(i) for i in range(16, 20)]
    client._outputs.close()
    engine_outputs.close()
