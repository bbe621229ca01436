"""Run a function on N ranks, each a spawned process in one gloo (or nccl) process group.

``run_ranks(target, args, world_size, init_file)`` starts the ranks, each of which calls
``init_distributed_environment``, then ``target(rank, world_size, *args)``, then
``destroy_distributed_environment``, and returns the ranks' results in rank order. A rank that
raises, dies or stays silent past ``timeout`` fails the caller with that rank's traceback and the
other ranks are terminated, so a rank blocked in a collective never hangs a test.
Results travel through a queue: return plain Python objects or numpy arrays, not tensors.
"""

from __future__ import annotations

import datetime
import queue as queue_module
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

POLL_SECONDS = 0.5


class RankFailed(RuntimeError):
    """A rank raised or died; the message carries its traceback."""


def _rank_main(
    target: Callable[..., Any],
    rank: int,
    world_size: int,
    init_method: str,
    backend: str | None,
    results: Any,
    args: tuple,
) -> None:
    import torch

    from pieceworks.distributed import (
        destroy_distributed_environment,
        init_distributed_environment,
    )

    torch.set_num_threads(1)  # ranks share the machine's cores
    try:
        init_distributed_environment(
            world_size,
            rank,
            backend=backend,
            init_method=init_method,
            timeout=datetime.timedelta(seconds=120),
        )
        results.put((rank, "ok", target(rank, world_size, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        destroy_distributed_environment()


def run_ranks(
    target: Callable[..., Any],
    args: tuple,
    init_file: Path,
    *,
    world_size: int = 2,
    backend: str | None = None,
    timeout: float = 120.0,
) -> list[Any]:
    """``target(rank, world_size, *args)`` on every rank; the results, in rank order."""
    context = mp.get_context("spawn")
    results = context.Queue()
    init_method = f"file://{init_file}"
    processes = [
        context.Process(
            target=_rank_main,
            args=(target, rank, world_size, init_method, backend, results, args),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    try:
        return _collect(results, processes, timeout)
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            process.join(timeout=10)


def _collect(results: Any, processes: list, timeout: float) -> list[Any]:
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(outputs) < len(processes):
        try:
            rank, status, payload = results.get(timeout=POLL_SECONDS)
        except queue_module.Empty:
            _check_alive(processes, outputs, deadline, timeout)
            continue
        if status == "error":
            raise RankFailed(f"rank {rank} failed:\n{payload}")
        outputs[rank] = payload
    return [outputs[rank] for rank in range(len(processes))]


def _check_alive(processes: list, outputs: dict, deadline: float, timeout: float) -> None:
    """Raise for a rank that died without a result, or when the time is up."""
    missing = [rank for rank in range(len(processes)) if rank not in outputs]
    for rank in missing:
        if processes[rank].exitcode not in (None, 0):
            raise RankFailed(f"rank {rank} died (exit code {processes[rank].exitcode})")
    if time.monotonic() > deadline:
        raise TimeoutError(f"ranks {missing} gave no result within {timeout:.0f} s")
