"""Executors: where the model runners live and how a step reaches them.

``UniprocExecutor`` (``tensor_parallel_size == 1``) holds the one ``ModelRunner`` in the engine's
process. ``MultiprocExecutor`` runs one rank per device on torch.distributed: this process is rank
0 (it schedules, and its runner is the engine's ``runner``), and ranks 1..N-1 are worker processes
(``worker/worker.py``) started with ``torch.multiprocessing`` spawn. Each step rank 0 broadcasts
the scheduled batch (``SchedulerOutput.detached()``: ids, counts, new token ids, blocks, slots,
sampling parameters) over the gloo group, then runs it itself; every rank runs the same step, the
all-reduces inside the model keep them in lock step, and every rank samples the same ids. A step
with a structured-output request sends its token bitmask in a second broadcast, once rank 0 has
launched its forward and filled the bitmask.

A caller that has already initialised the distributed environment itself
(``pieceworks.distributed.init_distributed_environment``) gets a ``UniprocExecutor`` on every rank:
each rank runs a whole engine and, the scheduler being deterministic, schedules the same steps;
nothing is broadcast (the tests' harness, and vLLM's "external launcher").

Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` set)
nothing is spawned: each launched process is the rank torchrun says, ranks other than 0 serve rank
0's steps inside the engine's constructor and exit the process when rank 0 shuts down, so only
rank 0 goes on with the script. Several hosts work the same way.

Start-up is in phases separated by gloo barriers (runner built and weights loaded; KV cache sized
to the smallest any rank can hold; graphs captured). A worker that fails reports its traceback on
a queue and exits; rank 0's next collective then fails and rank 0 raises that rank's error. Every
collective has the timeout ``PIECEWORKS_DIST_TIMEOUT_S``, so a rank lost inside a device
collective ends the run after it rather than hanging. ``shutdown()`` tells the workers to stop,
each rank frees its runner (graphs first) before the process group is destroyed.
"""

from __future__ import annotations

import atexit
import dataclasses
import queue
import socket
import sys
from typing import Any

from pieceworks import envs
from pieceworks.config import EngineConfig
from pieceworks.core.cache.triton_cache import use_kernel_compiler_environment
from pieceworks.logger import init_logger
from pieceworks.scheduler.output import SchedulerOutput
from pieceworks.worker.model_runner import ModelRunner
from pieceworks.worker.rank import STOP, dist_timeout, free_rank, start_rank
from pieceworks.worker.sampled_tokens import SampledTokens
from pieceworks.worker.structured_output import GrammarSource

logger = init_logger(__name__)


class UniprocExecutor:
    """One runner in this process: load, size the KV cache, capture."""

    def __init__(self, config: EngineConfig, runner_cls: type[ModelRunner] = ModelRunner) -> None:
        self.config = config
        self.runner = runner_cls(config)
        self.runner.initialize_kv_cache()
        self.runner.capture_model()

    def execute_async(
        self, output: SchedulerOutput, grammar: GrammarSource | None = None
    ) -> SampledTokens:
        return self.runner.execute_async(output, grammar)

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)

    def shutdown(self) -> None:
        """Free the runner's graphs (a caller that set up the process group destroys it next)."""
        if self.runner is not None:
            self.runner.release_graphs()


def torchrun_env() -> dict[str, int] | None:
    """``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` when this process was launched by torchrun."""
    rank, world_size, local_rank = envs.RANK, envs.WORLD_SIZE, envs.LOCAL_RANK
    if rank is None or world_size is None:
        return None
    return {"rank": rank, "world_size": world_size,
            "local_rank": rank if local_rank is None else local_rank}  # fmt: skip


def free_tcp_init_method() -> str:
    """``tcp://127.0.0.1:<free port>`` for ranks spawned on this host."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


def with_rank(config: EngineConfig, rank: int, local_rank: int) -> EngineConfig:
    parallel = dataclasses.replace(config.parallel_config, rank=rank, local_rank=local_rank)
    return dataclasses.replace(config, parallel_config=parallel)


def check_device_index(local_rank: int, world_size: int) -> None:
    """Device ``local_rank`` must exist, unless all ranks share one device (the CPU)."""
    from pieceworks.platforms import current_platform

    platform = current_platform()
    if platform.device(1) == platform.device(0) or local_rank < platform.device_count():
        return
    raise ValueError(
        f"tensor_parallel_size={world_size} needs device {local_rank} on this host, but "
        f"{platform.name} sees {platform.device_count()} device(s); lower tensor_parallel_size "
        "or make more devices visible (one rank per device)"
    )


class MultiprocExecutor(UniprocExecutor):
    """Rank 0 here, ranks 1..N-1 in spawned workers (or in torchrun's other processes)."""

    def __init__(self, config: EngineConfig, runner_cls: type[ModelRunner] = ModelRunner) -> None:
        from pieceworks.distributed.parallel_state import (
            get_tp_group,
            init_distributed_environment,
        )
        from pieceworks.worker import worker

        self.config = config
        world_size = config.parallel_config.tensor_parallel_size
        launched = torchrun_env()
        if launched is not None and launched["world_size"] != world_size:
            raise ValueError(
                f"torchrun started {launched['world_size']} processes but "
                f"tensor_parallel_size={world_size}; launch one process per rank"
            )
        rank = launched["rank"] if launched else 0
        local_rank = launched["local_rank"] if launched else 0
        # Spawned ranks 1..N-1 take devices 1..N-1 of this host; under torchrun only our own.
        check_device_index(local_rank if launched else world_size - 1, world_size)
        self.processes: list[Any] = []
        self.errors: Any = None
        self._closed = False
        if launched is None:
            self._spawn_workers(config, runner_cls, world_size)
        init_method = "env://" if launched else self.init_method
        try:
            init_distributed_environment(world_size, rank, local_rank, init_method=init_method,
                                         timeout=dist_timeout())  # fmt: skip
            config = with_rank(config, rank, local_rank)
            if rank != 0:  # torchrun: serve rank 0, then leave with it
                runner = start_rank(config, runner_cls)
                worker.serve(runner)
                free_rank(runner)
                sys.exit(0)
            self.group = get_tp_group()
            self.runner = start_rank(config, runner_cls)
        except Exception as error:
            from pieceworks.distributed.parallel_state import destroy_distributed_environment

            failure = self._worker_failure()
            self._stop_workers()
            destroy_distributed_environment()  # this process can build another engine after
            if failure is not None and not isinstance(error, ValueError):
                raise RuntimeError(f"tensor-parallel start-up failed on {failure}") from error
            raise  # rank 0's own error; a config or checkpoint error is every rank's, said once
        self._released: list[str] = []
        atexit.register(self.shutdown)

    def _spawn_workers(
        self, config: EngineConfig, runner_cls: type[ModelRunner], world_size: int
    ) -> None:
        import torch.multiprocessing as mp

        from pieceworks.platforms import current_platform
        from pieceworks.worker import worker

        platform_cls = type(current_platform())  # the workers use this process's platform
        context = mp.get_context("spawn")
        self.errors = context.Queue()
        self.init_method = free_tcp_init_method()
        for rank in range(1, world_size):
            process = context.Process(
                target=worker.run_worker,
                args=(
                    with_rank(config, rank, rank),
                    self.init_method,
                    self.errors,
                    runner_cls,
                    platform_cls,
                ),
                name=f"pieceworks-rank{rank}",
                daemon=True,
            )
            process.start()
            self.processes.append(process)

    def _worker_failure(self, wait_seconds: float = 10.0) -> str | None:
        """``rank r: <traceback>`` of the first worker that reported an error, if any did."""
        if self.errors is None:
            return None
        try:
            rank, trace = self.errors.get(timeout=wait_seconds)
        except queue.Empty:
            dead = [p.name for p in self.processes if not p.is_alive() and p.exitcode]
            return f"{', '.join(dead)} (exited without a report)" if dead else None
        return f"rank {rank}:\n{trace}"

    def execute_async(
        self, output: SchedulerOutput, grammar: GrammarSource | None = None
    ) -> SampledTokens:
        """Broadcast the step, then run it here. A constrained step's bitmask follows in a
        second broadcast, when this rank's runner asks for it (after launching its forward)."""
        message = (output.detached(), self._released, grammar is not None)
        try:
            self.group.broadcast_object(message, src=0)
        except Exception as error:
            failure = self._worker_failure(wait_seconds=1.0)
            if failure is not None:
                raise RuntimeError(f"tensor-parallel worker failed: {failure}") from error
            raise
        self._released = []
        if grammar is None:
            return self.runner.execute_async(output)
        source = grammar

        def broadcast_bitmask() -> Any:
            bitmask = source()
            self.group.broadcast_object(bitmask, src=0)
            return bitmask

        return self.runner.execute_async(output, broadcast_bitmask)

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)
        self._released.append(request_id)  # the workers forget it with the next step

    def shutdown(self) -> None:
        """Stop the workers, free rank 0's runner, destroy the process group; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        try:
            self.group.broadcast_object(STOP, src=0)
        except Exception as error:  # a worker already gone: still clean up here
            logger.warning("could not tell the workers to stop: %s", error)
        runner, self.runner = self.runner, None  # type: ignore[assignment]
        free_rank(runner)
        self._stop_workers()

    def _stop_workers(self, timeout: float = 30.0) -> None:
        for process in self.processes:
            process.join(timeout)
            if process.is_alive():
                logger.warning("%s did not stop in %.0f s; terminating it", process.name, timeout)
                process.terminate()
                process.join(5)
        self.processes = []


def make_executor(config: EngineConfig) -> UniprocExecutor:
    """One runner here for one rank, or when the caller already set up the distributed
    environment (then every rank runs its own engine and schedules the same steps); else rank 0
    here and the other ranks in workers."""
    from pieceworks.distributed.parallel_state import model_parallel_is_initialized

    use_kernel_compiler_environment(config)  # before any kernel compiles, inherited by ranks
    if config.parallel_config.tensor_parallel_size > 1 and not model_parallel_is_initialized():
        return MultiprocExecutor(config)
    return UniprocExecutor(config)
