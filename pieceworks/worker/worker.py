"""A tensor-parallel worker: ranks 1..N-1, each in its own process, serving rank 0's steps.

``run_worker`` is the spawned process's entry point: join the process group, start up in step
with the other ranks (``rank.start_rank``), report success or the traceback of what failed,
then ``serve``: receive each step rank 0 broadcasts and run it, until rank 0 says stop. The
worker's sampled ids are never read on its host; it keeps them on the device, where its next step
reads the decode tokens still in flight, exactly as rank 0 does.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

from pieceworks.config import EngineConfig
from pieceworks.logger import init_logger
from pieceworks.platforms import Platform, use_platform
from pieceworks.worker.model_runner import ModelRunner
from pieceworks.worker.rank import STOP, dist_timeout, free_rank, start_rank

logger = init_logger(__name__)


def run_worker(
    config: EngineConfig,
    init_method: str,
    errors: Any,
    runner_cls: type[ModelRunner],
    platform_cls: type[Platform],
) -> None:
    from pieceworks.distributed.parallel_state import init_distributed_environment

    parallel = config.parallel_config
    try:
        use_platform(platform_cls)
        init_distributed_environment(
            parallel.tensor_parallel_size,
            parallel.rank,
            parallel.local_rank,
            init_method=init_method,
            timeout=dist_timeout(),
        )
        runner = start_rank(config, runner_cls)
    except BaseException as error:
        trace = traceback.format_exc()
        # Printed here too: rank 0 may be blocked in a device collective and learn of it late.
        # A ValueError (a config or checkpoint error, which rank 0 reports itself) in one line.
        shown = str(error) if isinstance(error, ValueError) else trace
        logger.error("tensor-parallel rank %d failed at start-up: %s", parallel.rank, shown)
        errors.put((parallel.rank, trace))
        errors.close()
        errors.join_thread()  # the report is out before the process goes
        # Leave at once: a normal exit would run the process group's destructors, which can wait
        # on collectives rank 0 will never join; exiting closes this rank's sockets instead, so
        # rank 0's next collective fails and it reports this error.
        os._exit(1)
    try:
        serve(runner)
    except BaseException:
        logger.error("tensor-parallel rank %d failed:\n%s", parallel.rank, traceback.format_exc())
        os._exit(1)  # rank 0's next collective fails instead of waiting on this rank
    free_rank(runner)


def serve(runner: ModelRunner) -> None:
    """Run rank 0's steps until it broadcasts ``STOP``."""
    from pieceworks.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    while True:
        message = group.broadcast_object(None, src=0)
        if message == STOP:
            return
        output, released, constrained = message
        for request_id in released:
            runner.release(request_id)
        # A constrained step's bitmask is rank 0's second broadcast, taken where the runner
        # asks for it (after launching the forward), as rank 0's runner does.
        grammar = (lambda: group.broadcast_object(None, src=0)) if constrained else None
        runner.execute_async(output, grammar)
