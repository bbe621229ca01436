"""One tensor-parallel rank's life: its start-up in step with the others, its teardown, the stop.

Shared by rank 0's executor (``executor.py``) and the worker processes (``worker.py``), so that
neither imports the other: ``start_rank`` builds the runner, sizes the KV cache and captures
between barriers; ``free_rank`` frees graphs, then caches, then the process group; ``STOP`` is the
message rank 0 broadcasts to end a worker's loop.
"""

from __future__ import annotations

import datetime
import gc

from pieceworks import envs
from pieceworks.config import EngineConfig
from pieceworks.worker.model_runner import ModelRunner

STOP = "stop"  # the message that ends a worker's loop


def dist_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=envs.PIECEWORKS_DIST_TIMEOUT_S)


def start_rank(config: EngineConfig, runner_cls: type[ModelRunner]) -> ModelRunner:
    """This rank's start-up, in step with the others (the distributed environment is up)."""
    from pieceworks.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    runner = runner_cls(config)
    group.barrier()  # every rank built its model and loaded its shard
    runner.initialize_kv_cache()  # agrees on the smallest block count (see ModelRunner)
    runner.capture_model()
    group.barrier()  # every rank captured
    return runner


def free_rank(runner: ModelRunner | None) -> None:
    """Free the runner (graphs first, then caches) before the process group goes."""
    from pieceworks.distributed.parallel_state import destroy_distributed_environment
    from pieceworks.platforms import current_platform

    if runner is not None:
        runner.release_graphs()  # NCCL destroys no communicator a live graph still holds
    del runner
    gc.collect()
    current_platform().synchronize()
    current_platform().empty_cache()
    destroy_distributed_environment()
