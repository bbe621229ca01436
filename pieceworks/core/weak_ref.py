"""Weakly referenced tensors: views of memory that do not keep the memory alive.

A captured graph's output lives in the graph pool. Holding a normal reference to it would pin that
memory for the next (smaller) capture; a weak reference lets the pool reuse it, which is safe only
where nothing reads the tensor after the graph that produced it (the last piece).
"""

from __future__ import annotations

from typing import Any

import torch


def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor aliasing ``tensor``'s memory without owning it."""
    storage = torch._C._construct_storage_from_data_pointer(
        tensor.untyped_storage().data_ptr(), tensor.device, tensor.untyped_storage().nbytes()
    )
    alias = torch.empty((), dtype=tensor.dtype, device=tensor.device)
    return alias.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())


def weak_ref_tensors(value: Any) -> Any:
    """``weak_ref_tensor`` applied through tuples and lists; other values pass through."""
    if isinstance(value, torch.Tensor):
        return weak_ref_tensor(value)
    if isinstance(value, (list, tuple)):
        return type(value)(weak_ref_tensors(item) for item in value)
    return value
