"""Tensor-parallel collectives the models call.

The all-reduce after a row-parallel layer runs inside the compiled model through the custom op
``pieceworks::all_reduce`` (owned by ``parallel_state``, which registers it when the environment is
initialised, like vLLM's). It is not a splitting op: it lands inside the pieces, Inductor keeps it
as an extern call, and a static graph captures it like any kernel (NCCL collectives are capturable
in CUDA graphs). The all-gather of the logits runs eagerly, outside the graph, so it needs no op;
so does the runner's broadcast of rank 0's sampled ids (``same_on_every_rank``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pieceworks.distributed.parallel_state import (
    all_reduce_op,
    get_tp_group,
    model_parallel_is_initialized,
    tensor_parallel_rank_and_size,
)


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group through the traceable op; ``x`` itself when there is one rank."""
    if tensor_parallel_rank_and_size()[1] == 1:
        return x
    return all_reduce_op()(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (eager only: not an op); ``x`` at tp 1."""
    if tensor_parallel_rank_and_size()[1] == 1:
        return x
    return get_tp_group().all_gather(x, dim)


def same_on_every_rank(token_ids: torch.Tensor) -> torch.Tensor:
    """Rank 0's sampled ids on every rank (a device broadcast outside the graphs).

    Greedy and seeded rows would agree anyway (the gathered logits are identical); unseeded
    random rows draw from each rank's default generator, which code outside the engine may have
    advanced differently. Each rank feeds these ids to its next step.
    """
    if not model_parallel_is_initialized() or get_tp_group().world_size == 1:
        return token_ids
    group = get_tp_group()
    dist.broadcast(token_ids, src=group.ranks[0], group=group.device_group)
    return token_ids
