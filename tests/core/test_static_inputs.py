"""``cudagraph_copy_inputs``: static buffers for callers that pass fresh tensors every call.

Proves: only graph inputs whose first dim is symbolic get a buffer (not static tensors, scalars
or 0-dim tensors); the first call copies each into a buffer of its own, and a later, smaller call
copies its rows into the buffer's prefix and runs on a view of that prefix, at the buffer's
address, with the other inputs passed as they are; a call larger than the first is refused with
a message that says which input and what to do.
Run: pytest tests/core/test_static_inputs.py
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from pieceworks.core.static_inputs import StaticInputCopier, dynamic_input_indices


def fake(mode: FakeTensorMode, shape: tuple[int, ...], dynamic_dims: set[int]) -> torch.Tensor:
    dims = [
        DimDynamic.DYNAMIC if d in dynamic_dims else DimDynamic.STATIC for d in range(len(shape))
    ]
    context = StatelessSymbolicContext(dynamic_sizes=dims)
    return mode.from_tensor(torch.empty(shape), symbolic_context=context)


def test_only_inputs_with_a_symbolic_first_dim_get_a_buffer():
    mode = FakeTensorMode(shape_env=ShapeEnv())
    values = [
        fake(mode, (4, 8), {0}),  # the token dimension
        fake(mode, (8, 8), set()),  # a weight
        fake(mode, (8, 4), {1}),  # symbolic, but not the first dim
        fake(mode, (), set()),
        3,
        fake(mode, (4,), {0}),
    ]
    assert dynamic_input_indices(values) == [0, 5]


class Recorder:
    """The stitched module's stand-in: keeps what each call received."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __call__(self, *args):
        self.calls.append(args)
        return sum(arg.sum() for arg in args if isinstance(arg, torch.Tensor))


def test_later_calls_run_on_the_first_call_s_buffers():
    runnable = Recorder()
    copier = StaticInputCopier(runnable, [0])
    weight = torch.ones(2)
    first = torch.arange(8.0).reshape(4, 2)
    assert copier(first, weight) == first.sum() + 2
    (buffer_view, passed_weight) = runnable.calls[0]
    assert passed_weight is weight
    assert buffer_view is not first and buffer_view.data_ptr() != first.data_ptr()
    assert torch.equal(buffer_view, first)
    first.zero_()  # the buffer is a copy: the caller may reuse its tensor
    assert copier.buffers[0].sum() == 28.0

    later = torch.full((2, 2), 5.0)
    assert copier(later, weight) == 20.0 + 2
    (view, _) = runnable.calls[1]
    assert view.shape == (2, 2)
    assert view.data_ptr() == copier.buffers[0].data_ptr()
    assert torch.equal(copier.buffers[0][:2], later)
    assert torch.equal(copier.buffers[0][2:], torch.tensor([[4.0, 5.0], [6.0, 7.0]]))


def test_a_call_larger_than_the_first_is_refused_with_what_to_do():
    copier = StaticInputCopier(Recorder(), [1])
    copier(None, torch.zeros(2, 3))
    with pytest.raises(ValueError) as refused:
        copier(None, torch.zeros(3, 3))
    assert str(refused.value) == (
        "cudagraph_copy_inputs: input 1 has 3 rows, more than the first call's 2; make the "
        "first call the largest"
    )
