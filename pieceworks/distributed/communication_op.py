"""Tensor-parallel collectives, and the all-reduce as the custom op ``pieceworks::all_reduce``.

The all-reduce after a row-parallel layer runs inside the compiled model, so it is an op Dynamo
can trace: ``all_reduce(x) -> Tensor`` (out of place; the fake implementation returns an empty
tensor like ``x``, so tracing runs no collective). It is not a splitting op: it lands inside the
pieces, Inductor keeps it as an extern call, and a static graph captures it like any kernel (NCCL
collectives are capturable in CUDA graphs). The op is registered on first use, never at import.
The all-gather of the logits runs eagerly, outside the graph, so it needs no op.
"""

from __future__ import annotations

from typing import Any

import torch

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.distributed.parallel_state import get_tp_group, tensor_parallel_rank_and_size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over the tensor-parallel group, into a new tensor (``x`` is not written)."""
    return get_tp_group().all_reduce(x.clone())


def all_reduce_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_all_reduce_op: Any = None


def all_reduce_op() -> Any:
    """``torch.ops.pieceworks.all_reduce``, registered on first use.

    ``init_distributed_environment`` calls this: registering cannot be traced, so the op must
    exist before Dynamo meets the first ``tensor_model_parallel_all_reduce``.
    """
    global _all_reduce_op
    _all_reduce_op = direct_register_custom_op(
        "all_reduce", all_reduce, mutates_args=[], fake_impl=all_reduce_fake
    )
    return _all_reduce_op


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group through the traceable op; ``x`` itself when there is one rank."""
    if tensor_parallel_rank_and_size()[1] == 1:
        return x
    op = _all_reduce_op if _all_reduce_op is not None else all_reduce_op()
    return op(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (eager only: not an op); ``x`` at tp 1."""
    if tensor_parallel_rank_and_size()[1] == 1:
        return x
    return get_tp_group().all_gather(x, dim)
