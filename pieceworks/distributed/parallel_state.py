"""Process-global tensor-parallel state: the default process group and the TP group over it.

``init_distributed_environment(world_size, rank)`` joins the default process group (the platform's
``dist_backend``: NCCL, RCCL, gloo) and builds the tensor-parallel group, which spans every rank.
Layers ask ``tensor_parallel_rank_and_size()`` at construction how to shard themselves; it says
``(0, 1)`` until the environment is initialised, so a single-process engine needs no set-up.
``destroy_distributed_environment()`` tears it all down (after the static graphs are freed).

The group's all-reduce is also the custom op ``pieceworks::all_reduce`` (``all_reduce_op()``), so
that Dynamo traces it into the compiled pieces: ``all_reduce(x) -> Tensor``, out of place, with a
fake implementation returning an empty tensor like ``x`` (tracing runs no collective). It is
registered when the environment is initialised (registering cannot happen inside a trace), never
at import.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.logger import init_logger
from pieceworks.platforms import current_platform

logger = init_logger(__name__)


class GroupCoordinator:
    """One group of ranks seen from this process: tensors on ``device_group``, objects on gloo.

    ``device_group`` runs tensor collectives with the device backend; ``cpu_group`` is a gloo group
    for Python objects (the same group where the device backend is gloo). Every rank of the group
    must call each collective, in the same order.
    """

    def __init__(self, ranks: list[int], local_rank: int, backend: str) -> None:
        self.ranks = list(ranks)
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(dist.get_rank())
        self.local_rank = local_rank  # the device index this process drives
        self.backend = backend
        self.device_group: Any = dist.new_group(self.ranks, backend=backend)
        self.cpu_group: Any = (
            self.device_group if backend == "gloo" else dist.new_group(self.ranks, backend="gloo")
        )

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of ``tensor`` over the group, reduced in place; returns ``tensor``."""
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim``, in rank order."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor, group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """``obj`` of the group's rank ``src``, on every rank (pickled, over the gloo group)."""
        if self.world_size == 1:
            return obj
        objects = [obj if self.rank_in_group == src else None]
        dist.broadcast_object_list(objects, src=self.ranks[src], group=self.cpu_group)
        return objects[0]

    def barrier(self) -> None:
        dist.barrier(group=self.cpu_group)

    def __repr__(self) -> str:
        return (
            f"GroupCoordinator(rank_in_group={self.rank_in_group}, world_size={self.world_size}, "
            f"backend={self.backend!r})"
        )


_TP: GroupCoordinator | None = None


def init_distributed_environment(
    world_size: int,
    rank: int,
    local_rank: int | None = None,
    *,
    backend: str | None = None,
    init_method: str = "env://",
    timeout: datetime.timedelta | None = None,
) -> None:
    """Join the default process group and build the tensor-parallel group (all ranks).

    ``backend`` defaults to ``current_platform().dist_backend``; ``local_rank`` (default: ``rank``)
    is the device this process binds to. A default group that already exists with this world
    size and rank is reused; calling again with the same world is a no-op.
    """
    global _TP
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if _TP is not None:
        if (_TP.world_size, _TP.rank_in_group) == (world_size, rank):
            return
        raise RuntimeError(
            f"the distributed environment is already initialised as rank {_TP.rank_in_group} of "
            f"{_TP.world_size}; call destroy_distributed_environment() before re-initialising"
        )
    platform = current_platform()
    backend = backend or platform.capabilities().dist_backend
    local_rank = rank if local_rank is None else local_rank
    platform.set_device(platform.device(local_rank))  # NCCL binds communicators to it
    if not dist.is_initialized():
        options: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(
            backend=backend, init_method=init_method, world_size=world_size, rank=rank, **options
        )
    elif (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
        raise RuntimeError(
            f"torch.distributed is already initialised as rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, not rank {rank} of {world_size}"
        )
    _TP = GroupCoordinator(list(range(world_size)), local_rank, backend)
    all_reduce_op()  # registered now: registering inside a Dynamo trace would fail
    logger.info("tensor parallelism: rank %d of %d (%s)", rank, world_size, backend)


def get_tp_group() -> GroupCoordinator:
    """The tensor-parallel group; a RuntimeError before ``init_distributed_environment``."""
    if _TP is None:
        raise RuntimeError(
            "tensor parallelism is not initialised: call "
            "pieceworks.distributed.init_distributed_environment(world_size, rank) first"
        )
    return _TP


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def tensor_parallel_rank_and_size() -> tuple[int, int]:
    """``(tp_rank, tp_size)`` of this process; ``(0, 1)`` when not initialised."""
    if _TP is None:
        return 0, 1
    return _TP.rank_in_group, _TP.world_size


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
    if _all_reduce_op is None:
        _all_reduce_op = direct_register_custom_op(
            "all_reduce", all_reduce, mutates_args=[], fake_impl=all_reduce_fake
        )
    return _all_reduce_op


def destroy_distributed_environment() -> None:
    """Destroy every process group and forget the TP group; safe to call twice."""
    global _TP
    _TP = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
