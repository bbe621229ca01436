"""Tensor parallelism: the process-global group state and the collectives the models call.

``parallel_state`` owns the groups (one tensor-parallel group spanning every rank, plus a gloo
group for object broadcasts) and the group's all-reduce registered as the custom op
``pieceworks::all_reduce`` that Dynamo traces into the compiled pieces and the static graphs
capture; ``communication_op`` owns the collectives the models call. Imports run ``models`` ->
``distributed`` -> ``core`` -> ``platforms``; nothing here knows a model. Importing it
initialises nothing.
"""

from pieceworks.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pieceworks.distributed.parallel_state import (
    GroupCoordinator,
    destroy_distributed_environment,
    get_tp_group,
    init_distributed_environment,
    model_parallel_is_initialized,
    tensor_parallel_rank_and_size,
)

__all__ = [
    "GroupCoordinator",
    "destroy_distributed_environment",
    "get_tp_group",
    "init_distributed_environment",
    "model_parallel_is_initialized",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
    "tensor_parallel_rank_and_size",
]
