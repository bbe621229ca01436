"""``cudagraph_copy_inputs``: static input buffers for callers that cannot keep addresses fixed.

The runner normally owns persistent buffers and copies each step's inputs into their prefix. A
caller that passes fresh tensors every call (a script, a test) can turn this on instead: the buffers
are sized by the first call (which must be the largest), and every call copies its dynamic-size
tensor inputs into the buffers' prefix before running the stitched module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def dynamic_input_indices(placeholder_values: Sequence[Any]) -> list[int]:
    """Positions of the graph inputs whose first dim is symbolic (the token dimension)."""
    return [
        i
        for i, x in enumerate(placeholder_values)
        if isinstance(x, torch.Tensor) and x.dim() > 0 and isinstance(x.shape[0], torch.SymInt)
    ]


class StaticInputCopier:
    """Calls ``runnable`` on static buffers holding a copy of each call's tensor inputs."""

    def __init__(self, runnable: Callable[..., Any], dynamic_indices: list[int]) -> None:
        self.runnable = runnable
        # Inputs with a symbolic first dim (``dynamic_input_indices``) get a buffer; parameters
        # and buffers of the model already live at fixed addresses.
        self.dynamic_indices = dynamic_indices
        self.buffers: dict[int, torch.Tensor] = {}

    def __call__(self, *args: Any) -> Any:
        args_list = list(args)
        for index in self.dynamic_indices:
            value = args_list[index]
            buffer = self.buffers.get(index)
            if buffer is None:
                buffer = self.buffers[index] = value.clone()
            elif value.shape[0] > buffer.shape[0]:
                raise ValueError(
                    f"cudagraph_copy_inputs: input {index} has {value.shape[0]} "
                    f"rows, more than the first call's {buffer.shape[0]}; make the "
                    "first call the largest"
                )
            else:
                buffer[: value.shape[0]].copy_(value)
            args_list[index] = buffer[: value.shape[0]]
        return self.runnable(*args_list)
