"""The executors and the worker loop, run in this process (no worker process is started).

``MultiprocExecutor`` runs here as rank 0 of a one-rank gloo group (``tensor_parallel_size=1``,
so nothing is spawned and every collective is real), or with stand-ins for the launcher's
pieces where a test needs other ranks: the spawn context, the process group, the rank start-up.
llama-tiny at level 0 on CPU, float32.

Proves: ``with_rank`` sets the rank and local rank and nothing else; ``UniprocExecutor`` builds
its runner, sizes the KV cache and captures, in that order, and hands steps, releases and the
shutdown to it; ``make_executor`` picks the multi-process executor only for more than one rank
without a distributed environment; an engine over ``MultiprocExecutor`` gives the greedy tokens
of the single-process engine, broadcasts every step's detached batch with the ids released since
the step before, and on shutdown broadcasts ``STOP`` before it frees the runner and then stops
the workers, once; a start-up error is raised as rank 0's own (a ``ValueError`` is every rank's)
or as the failing worker's, after the workers are stopped and the process group destroyed; a
broadcast that fails names the worker that failed; ``torchrun`` with another world size, and more
ranks than devices, are refused with their messages; a torchrun rank other than 0 serves rank
0's steps and leaves; ``_spawn_workers`` starts ranks 1..N-1 with their own rank and device;
``_stop_workers`` terminates a worker that does not stop; a dead worker without a report is named;
the worker loop releases, then runs, each step until ``STOP``; a worker that fails while serving
logs its rank and the traceback and exits with status 1, and one that fails at start-up puts
(rank, traceback) on rank 0's queue, flushes it and exits with status 1.
Run: pytest tests/worker/test_multiproc_executor.py
"""

from __future__ import annotations

import dataclasses
import queue
import types

import pytest
import torch

from pieceworks import platforms
from pieceworks.distributed import parallel_state
from pieceworks.engine import core as engine_core
from pieceworks.engine.arg_utils import build_engine_config
from pieceworks.engine.llm import LLM
from pieceworks.sampling_params import SamplingParams
from pieceworks.worker import executor as executor_module
from pieceworks.worker import structured_output as structured_output_module
from pieceworks.worker import worker
from pieceworks.worker.executor import (
    MultiprocExecutor,
    UniprocExecutor,
    make_executor,
    with_rank,
)
from pieceworks.worker.rank import STOP

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = [[3, 14, 15, 92], [6, 5]]
ENGINE_ARGS = {"dtype": "float32", "max_num_seqs": 2}


def make_config(tensor_parallel_size: int = 1):
    return build_engine_config(
        "llama-tiny", {"level": 0}, tensor_parallel_size=tensor_parallel_size, **ENGINE_ARGS
    )


@pytest.fixture(scope="module")
def offline() -> list[list[int]]:
    llm = LLM("llama-tiny", compilation_config={"level": 0}, **ENGINE_ARGS)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(autouse=True)
def _no_torchrun_and_no_atexit(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    hooks = types.SimpleNamespace(registered=[], unregistered=[])
    hooks.register, hooks.unregister = hooks.registered.append, hooks.unregistered.append
    monkeypatch.setattr(executor_module, "atexit", hooks)
    yield hooks
    parallel_state.destroy_distributed_environment()


class RecordingRunner:
    """A runner that records what it is asked, in order."""

    def __init__(self, config, calls: list | None = None) -> None:
        self.config = config
        self.calls = [("init", config)] if calls is None else calls

    def initialize_kv_cache(self) -> None:
        self.calls.append(("initialize_kv_cache",))

    def capture_model(self) -> None:
        self.calls.append(("capture_model",))

    def execute_async(self, output, grammar=None):
        self.calls.append(("execute_async", output))
        if grammar is not None:  # asked once per step, after the forward's launch
            self.calls.append(("bitmask", grammar()))
        return ("sampled", output)

    def release(self, request_id: str) -> None:
        self.calls.append(("release", request_id))

    def release_graphs(self) -> None:
        self.calls.append(("release_graphs",))


class RecordingGroup:
    """A group whose ``broadcast_object`` records each object (and raises ``error`` if set)."""

    def __init__(self, inner=None, error: Exception | None = None) -> None:
        self.inner, self.error, self.sent = inner, error, []

    def broadcast_object(self, obj=None, src: int = 0):
        self.sent.append((obj, src))
        if self.error is not None:
            raise self.error
        return obj if self.inner is None else self.inner.broadcast_object(obj, src)


def test_with_rank_sets_the_rank_and_the_device_only():
    config = make_config(4)
    ranked = with_rank(config, 3, 1)
    parallel = ranked.parallel_config
    assert (parallel.tensor_parallel_size, parallel.rank, parallel.local_rank) == (4, 3, 1)
    assert dataclasses.replace(ranked, parallel_config=config.parallel_config) == config
    assert (config.parallel_config.rank, config.parallel_config.local_rank) == (0, 0)


def test_the_uniproc_executor_builds_sizes_and_captures_then_delegates():
    config = make_config()
    executor = UniprocExecutor(config, runner_cls=RecordingRunner)
    runner = executor.runner
    assert executor.config is config
    assert runner.calls == [("init", config), ("initialize_kv_cache",), ("capture_model",)]
    assert executor.execute_async("step") == ("sampled", "step")
    executor.release("a")
    executor.shutdown()
    assert runner.calls[3:] == [("execute_async", "step"), ("release", "a"), ("release_graphs",)]
    executor.runner = None
    executor.shutdown()  # nothing left to free


def test_make_executor_spawns_only_for_several_ranks_without_a_distributed_environment(
    monkeypatch,
):
    made = []
    monkeypatch.setattr(executor_module, "UniprocExecutor", lambda c: made.append("uniproc"))
    monkeypatch.setattr(executor_module, "MultiprocExecutor", lambda c: made.append("multiproc"))
    make_executor(make_config(1))
    make_executor(make_config(2))
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: True)
    make_executor(make_config(2))
    make_executor(make_config(1))
    assert made == ["uniproc", "multiproc", "uniproc", "uniproc"]


def test_an_engine_over_the_multiproc_executor_broadcasts_each_step(
    monkeypatch, offline, _no_torchrun_and_no_atexit
):
    monkeypatch.setattr(engine_core, "make_executor", MultiprocExecutor)
    llm = LLM("llama-tiny", compilation_config={"level": 0}, **ENGINE_ARGS)
    executor = llm.engine.executor
    assert isinstance(executor, MultiprocExecutor) and executor.processes == []
    assert executor.init_method.startswith("tcp://127.0.0.1:")
    assert parallel_state.get_tp_group().world_size == 1
    assert executor.group is parallel_state.get_tp_group()  # the group every step goes over
    assert _no_torchrun_and_no_atexit.registered == [executor.shutdown]
    group = executor.group = RecordingGroup(executor.group)
    first = llm.generate(PROMPTS[:1], GREEDY)
    second = llm.generate(PROMPTS[1:], GREEDY)
    assert [out.outputs[0].token_ids for out in first + second] == offline
    steps = [obj for obj, _ in group.sent]
    assert {src for _, src in group.sent} == {0}
    assert len(steps) == 2 * GREEDY.max_tokens  # one per step, a step per token of each request
    assert not any(constrained for _, _, constrained in steps)  # no bitmask follows any
    first_id, second_id = [out.request_id for out in first + second]
    scheduled = [[s.request.request_id for s in output.scheduled_requests] for output, *_ in steps]
    assert scheduled == [[first_id]] * 4 + [[second_id]] * 4
    views = [output.scheduled_requests[0].request for output, *_ in steps]
    assert all(v.prompt_token_ids == [] and v.output_token_ids == [] for v in views)  # detached
    released = [ids for _, ids, _ in steps]
    assert released == [[], [], [], [], [first_id], [], [], []]  # with the step after the release
    assert executor._released == [second_id]

    calls = []
    real_free_rank = executor_module.free_rank

    def free_rank(runner):
        calls.append(("free_rank", runner))
        real_free_rank(runner)

    monkeypatch.setattr(executor_module, "free_rank", free_rank)
    monkeypatch.setattr(executor, "_stop_workers", lambda: calls.append(("stop_workers",)))
    runner = executor.runner
    llm.shutdown()
    assert group.sent[-1] == (STOP, 0)
    assert calls == [("free_rank", runner), ("stop_workers",)]
    assert executor.runner is None and not parallel_state.model_parallel_is_initialized()
    assert _no_torchrun_and_no_atexit.unregistered == [executor.shutdown]
    executor.shutdown()  # once
    assert len(group.sent) == len(steps) + 1 and len(calls) == 2


def standin_start(monkeypatch, error: Exception | None, report=None):
    """Rank 0's start-up with the workers' error queue holding ``report``, raising ``error``."""

    def spawn(self, config, runner_cls, world_size):
        self.errors = None if report is None else queue.Queue()
        if report is not None:
            self.errors.put(report)
        self.init_method = executor_module.free_tcp_init_method()

    def start_rank(config, runner_cls):
        assert parallel_state.model_parallel_is_initialized()
        if error is not None:
            raise error
        return RecordingRunner(config)

    monkeypatch.setattr(MultiprocExecutor, "_spawn_workers", spawn)
    monkeypatch.setattr(executor_module, "start_rank", start_rank)


def test_a_start_up_error_is_rank_0_s_own_or_the_failing_worker_s(monkeypatch):
    report = (1, "Traceback: out of memory")
    closed = RuntimeError("gloo: connection closed")
    standin_start(monkeypatch, closed, report)
    with pytest.raises(RuntimeError) as raised:
        MultiprocExecutor(make_config())
    assert (
        str(raised.value) == "tensor-parallel start-up failed on rank 1:\nTraceback: out of memory"
    )
    assert raised.value.__cause__ is closed
    assert not parallel_state.model_parallel_is_initialized()  # another engine can start
    for error, worker_report in [(ValueError("bad checkpoint"), report), (closed, None)]:
        standin_start(monkeypatch, error, worker_report)
        with pytest.raises(type(error)) as raised:
            MultiprocExecutor(make_config())
        assert raised.value is error
        assert not parallel_state.model_parallel_is_initialized()


def test_a_failed_broadcast_names_the_worker_that_failed(monkeypatch):
    standin_start(monkeypatch, None)
    executor = MultiprocExecutor(make_config())
    closed = RuntimeError("gloo: connection closed")
    executor.group = RecordingGroup(error=closed)
    with pytest.raises(RuntimeError) as raised:
        executor.execute_async(types.SimpleNamespace(detached=lambda: "detached"))
    assert raised.value is closed  # no worker reported: rank 0's own error
    executor.errors = queue.Queue()
    executor.errors.put((1, "Traceback: killed"))
    executor.release("a")
    with pytest.raises(RuntimeError) as raised:
        executor.execute_async(types.SimpleNamespace(detached=lambda: "detached"))
    assert str(raised.value) == "tensor-parallel worker failed: rank 1:\nTraceback: killed"
    assert raised.value.__cause__ is closed
    assert executor.group.sent[-1] == (("detached", ["a"], False), 0)
    assert executor._released == ["a"]  # not sent: still to be sent
    executor.shutdown()  # the STOP broadcast fails too: rank 0 still frees its runner
    assert executor.group.sent[-1] == (STOP, 0) and executor.runner is None
    assert not parallel_state.model_parallel_is_initialized()


def test_a_torchrun_of_another_size_or_more_ranks_than_devices_is_refused(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError) as error:
        MultiprocExecutor(make_config(2))
    assert str(error.value) == (
        "torchrun started 3 processes but tensor_parallel_size=2; launch one process per rank"
    )
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")

    class OneDevice:
        name = "onedevice"

        def device(self, index: int = 0) -> tuple[str, int]:
            return ("accelerator", index)

        def device_count(self) -> int:
            return 1

    config = make_config(2)
    monkeypatch.setattr(platforms, "_current", OneDevice())
    spawned = []
    monkeypatch.setattr(MultiprocExecutor, "_spawn_workers", lambda *args: spawned.append(args))
    with pytest.raises(ValueError) as error:
        MultiprocExecutor(config)
    assert str(error.value) == (
        "tensor_parallel_size=2 needs device 1 on this host, but onedevice sees 1 device(s); "
        "lower tensor_parallel_size or make more devices visible (one rank per device)"
    )
    assert spawned == []


def test_a_torchrun_rank_other_than_0_serves_rank_0_and_leaves(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    calls = []
    runner = RecordingRunner(None)
    monkeypatch.setattr(MultiprocExecutor, "_spawn_workers", lambda *a: calls.append("spawn"))

    def init_distributed_environment(*args, init_method, timeout):
        calls.append(("init", args, init_method))

    def start_rank(config, runner_cls):
        calls.append(("start", config.parallel_config))
        return runner

    monkeypatch.setattr(
        parallel_state, "init_distributed_environment", init_distributed_environment
    )
    monkeypatch.setattr(executor_module, "start_rank", start_rank)
    monkeypatch.setattr(worker, "serve", lambda r: calls.append(("serve", r)))
    monkeypatch.setattr(executor_module, "free_rank", lambda r: calls.append(("free", r)))
    config = make_config(2)
    with pytest.raises(SystemExit) as exit_:
        MultiprocExecutor(config, runner_cls=RecordingRunner)
    assert exit_.value.code == 0
    assert calls == [
        ("init", (2, 1, 0), "env://"),
        ("start", dataclasses.replace(config.parallel_config, rank=1, local_rank=0)),
        ("serve", runner),
        ("free", runner),
    ]


def test_spawned_workers_are_ranks_1_to_n_minus_1_on_their_own_device(monkeypatch):
    import torch.multiprocessing

    started = []

    class Process:
        def __init__(self, target, args, name, daemon) -> None:
            self.target, self.args, self.name, self.daemon = target, args, name, daemon

        def start(self) -> None:
            started.append(self.name)

    context = types.SimpleNamespace(Queue=queue.Queue, Process=Process)
    methods = []
    monkeypatch.setattr(
        torch.multiprocessing, "get_context", lambda method: methods.append(method) or context
    )
    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor.processes = []
    executor._spawn_workers(make_config(4), RecordingRunner, 4)
    assert methods == ["spawn"]
    assert started == ["pieceworks-rank1", "pieceworks-rank2", "pieceworks-rank3"]
    assert isinstance(executor.errors, queue.Queue)
    assert executor.init_method.startswith("tcp://127.0.0.1:")
    platform_cls = type(platforms.current_platform())
    for rank, process in enumerate(executor.processes, start=1):
        assert process.target is worker.run_worker and process.daemon is True
        ranked, init_method, errors, runner_cls, platform = process.args
        assert (ranked.parallel_config.rank, ranked.parallel_config.local_rank) == (rank, rank)
        assert ranked.parallel_config.tensor_parallel_size == 4
        assert (init_method, errors) == (executor.init_method, executor.errors)
        assert (runner_cls, platform) == (RecordingRunner, platform_cls)


class StandinProcess:
    def __init__(self, name: str, stops: bool, exitcode: int | None = None) -> None:
        self.name, self.stops, self.exitcode, self.calls = name, stops, exitcode, []
        self.alive = True

    def join(self, timeout) -> None:
        self.calls.append(("join", timeout))
        if self.stops:
            self.alive = False

    def is_alive(self) -> bool:
        return self.alive

    def terminate(self) -> None:
        self.calls.append(("terminate",))
        self.stops = True


def test_a_worker_that_does_not_stop_is_terminated():
    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    stops, hangs = (
        StandinProcess("pieceworks-rank1", True),
        StandinProcess("pieceworks-rank2", False),
    )
    executor.processes = [stops, hangs]
    executor._stop_workers(timeout=0.5)
    assert stops.calls == [("join", 0.5)]
    assert hangs.calls == [("join", 0.5), ("terminate",), ("join", 5)]
    assert executor.processes == []


def test_a_dead_worker_without_a_report_is_named():
    executor = MultiprocExecutor.__new__(MultiprocExecutor)
    executor.errors = queue.Queue()
    dead = StandinProcess("pieceworks-rank2", True, exitcode=1)
    dead.alive = False
    clean = StandinProcess("pieceworks-rank3", True, exitcode=0)
    clean.alive = False
    executor.processes = [StandinProcess("pieceworks-rank1", False), dead, clean]
    assert (
        executor._worker_failure(wait_seconds=0.0) == "pieceworks-rank2 (exited without a report)"
    )
    executor.processes = [clean]
    assert executor._worker_failure(wait_seconds=0.0) is None


def test_the_worker_loop_releases_then_runs_each_step_until_stop(monkeypatch):
    messages = [("step 1", [], False), ("step 2", ["a", "b"], True), "bitmask 2", STOP, "never"]
    received = []
    group = types.SimpleNamespace(
        broadcast_object=lambda obj, src: received.append((obj, src)) or messages.pop(0)
    )
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: group)
    runner = RecordingRunner(None, calls=[])
    worker.serve(runner)
    assert runner.calls == [
        ("execute_async", "step 1"),
        ("release", "a"),
        ("release", "b"),
        ("execute_async", "step 2"),
        ("bitmask", "bitmask 2"),  # a constrained step's second broadcast, where the runner asks
    ]
    assert messages == ["never"] and received == [(None, 0)] * 4


def test_a_constrained_step_broadcasts_its_bitmask_after_the_step(
    monkeypatch, tmp_path, _no_torchrun_and_no_atexit
):
    """Rank 0 sends the step, launches it, and sends the bitmask its runner applied when the
    runner asks for it; a free step sends nothing more."""
    pytest.importorskip("xgrammar")
    from pieceworks.sampling_params import StructuredOutputsParams
    from tests.engine.tiny_tokenizer import save_tiny_tokenizer

    monkeypatch.setattr(engine_core, "make_executor", MultiprocExecutor)
    tokenizer = save_tiny_tokenizer(tmp_path)
    llm = LLM("llama-tiny", compilation_config={"level": 0}, tokenizer=tokenizer, **ENGINE_ARGS)
    executor = llm.engine.executor
    group = executor.group = RecordingGroup(executor.group)
    applied = []
    real_apply = structured_output_module.apply_grammar_bitmask
    monkeypatch.setattr(
        structured_output_module,
        "apply_grammar_bitmask",
        lambda logits, bitmask, *staging: (
            applied.append(bitmask.clone()) or real_apply(logits, bitmask, *staging)
        ),
    )
    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=choice)
    (out,) = llm.generate(["a"], params)
    assert out.outputs[0].text in ("yes", "no")
    sent = [obj for obj, _ in group.sent]
    steps = [index for index, obj in enumerate(sent) if isinstance(obj, tuple)]
    assert steps and all(sent[index][2] for index in steps)  # each step says a bitmask follows
    bitmasks = [sent[index + 1] for index in steps]
    assert len(bitmasks) == len(applied) == len(sent) - len(steps)
    for broadcast, used in zip(bitmasks, applied, strict=True):
        assert torch.equal(broadcast, used)
    llm.shutdown()


class Exited(Exception):
    """``os._exit`` in a test: the status it was called with, instead of leaving the process."""


class ErrorQueue:
    """The spawn context's error queue as ``run_worker`` uses it: what was put, and in order."""

    def __init__(self):
        self.calls = []

    def put(self, item):
        self.calls.append(("put", item))

    def close(self):
        self.calls.append(("close",))

    def join_thread(self):
        self.calls.append(("join_thread",))


def _worker_process(monkeypatch, start_rank, serve):
    """``run_worker``'s surroundings stubbed: no platform switch, no process group, ``os._exit``
    raising ``Exited``, this ``start_rank`` and ``serve``; the worker's error records."""
    import logging

    def exit_(status):
        raise Exited(status)

    monkeypatch.setattr(worker, "use_platform", lambda cls: None)
    monkeypatch.setattr(parallel_state, "init_distributed_environment", lambda *a, **k: None)
    monkeypatch.setattr(worker, "start_rank", start_rank)
    monkeypatch.setattr(worker, "serve", serve)
    monkeypatch.setattr(worker.os, "_exit", exit_)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    worker.logger.addHandler(handler)  # the caller removes it
    return records, handler


def test_a_worker_that_fails_while_serving_says_which_rank_and_exits_with_status_1(monkeypatch):
    def serve(runner):
        raise RuntimeError("the device fell over")

    records, handler = _worker_process(monkeypatch, lambda config, cls: "runner", serve)
    config = with_rank(build_engine_config("llama-tiny", None, tensor_parallel_size=2), 1, 1)
    try:
        with pytest.raises(Exited) as exited:
            worker.run_worker(config, "tcp://127.0.0.1:1", ErrorQueue(), None, None)
    finally:
        worker.logger.removeHandler(handler)
    assert exited.value.args == (1,)
    ((record,),) = [[r for r in records if r.levelname == "ERROR"]]
    message = record.getMessage()
    assert message.startswith("tensor-parallel rank 1 failed:\nTraceback (most recent call last):")
    assert message.endswith("RuntimeError: the device fell over\n")


def test_a_worker_that_fails_at_start_up_reports_to_rank_0_then_exits(monkeypatch):
    def start_rank(config, cls):
        raise ValueError("num_attention_heads=4 is not divisible by tensor_parallel_size=3")

    records, handler = _worker_process(monkeypatch, start_rank, lambda runner: None)
    config = with_rank(build_engine_config("llama-tiny", None, tensor_parallel_size=2), 1, 1)
    errors = ErrorQueue()
    try:
        with pytest.raises(Exited) as exited:
            worker.run_worker(config, "tcp://127.0.0.1:1", errors, None, None)
    finally:
        worker.logger.removeHandler(handler)
    assert exited.value.args == (1,)
    (put, close, join) = errors.calls
    assert put[0] == "put" and put[1][0] == 1
    assert put[1][1].endswith(
        "ValueError: num_attention_heads=4 is not divisible by tensor_parallel_size=3\n"
    )
    assert (close, join) == (("close",), ("join_thread",))  # the report is out before the exit
    assert [r.getMessage() for r in records if r.levelname == "ERROR"] == [
        "tensor-parallel rank 1 failed at start-up: num_attention_heads=4 is not divisible by "
        "tensor_parallel_size=3"
    ]
