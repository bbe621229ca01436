"""Splitting submodules call their op's registered function directly, with the same effect.

A splitting submodule that is one call of an op registered by ``direct_register_custom_op`` for
the platform's dispatch key becomes a ``SplittingCall`` on the stitched module: every layer's
does in the toy model, the op still runs once per layer per call (eagerly, between the pieces,
also under PIECEWISE replay), outputs equal those of the submodules called through ``torch.ops``,
and the stitched module still pickles as its graph. A call whose op takes every input once, in
order, then constants passes them straight on; any other gathers its arguments per call. A
submodule of more than the call, an op registered elsewhere or for another dispatch key, an
argument that is neither an input nor a plain constant, or an op result the graph reads, keeps
its ``GraphModule``.
Run: pytest tests/core/test_splitting_call.py
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.fx

from pieceworks.core import custom_op
from pieceworks.core.config import CUDAGraphMode
from pieceworks.core.forward_context import BatchDescriptor
from pieceworks.core.splitting_call import SplittingCall, bind_splitting_calls, splitting_call
from pieceworks.core.warm_start.traced_graph_store import portable_graph_module
from tests.core.test_piecewise import build, capture_all, device, make_config, run
from tests.core.toy_model import silly_attention_op, silly_calls

pytestmark = pytest.mark.platform_agnostic


def stitched_module(model) -> torch.fx.GraphModule:
    backend = model._pieceworks_compiler.piecewise_backend
    assert backend is not None and backend.split_gm is not None
    return backend.split_gm


@pytest.mark.parametrize("num_layers", [1, 3])
def test_every_splitting_submodule_calls_its_op_directly(graph_platform, num_layers):
    sizes = [1, 2, 4]
    config = make_config(CUDAGraphMode.PIECEWISE, sizes)
    model = build(config, num_layers)
    static_x = torch.randn(4, 8, device=device())
    capture_all(model, config, static_x, sizes, CUDAGraphMode.PIECEWISE)
    split_gm = stitched_module(model)
    direct = [
        name for name in split_gm._modules if isinstance(getattr(split_gm, name), SplittingCall)
    ]
    assert len(direct) == num_layers  # one splitting submodule per layer, each bound
    for size in sizes:
        static_x[:size].copy_(torch.randn(size, 8))
        calls_before = silly_calls["count"]
        replayed = run(
            model, config, static_x[:size], CUDAGraphMode.PIECEWISE, BatchDescriptor(size)
        ).clone()
        assert silly_calls["count"] == calls_before + num_layers
        for name in direct:  # the same step through torch.ops
            del split_gm.__dict__[name]
        through_ops = run(
            model, config, static_x[:size], CUDAGraphMode.PIECEWISE, BatchDescriptor(size)
        )
        assert torch.equal(replayed, through_ops)
        assert bind_splitting_calls(split_gm) == num_layers
    restored = pickle.loads(pickle.dumps(portable_graph_module(split_gm)))
    assert all(isinstance(restored._modules[name], torch.fx.GraphModule) for name in direct)


def one_call_graph(
    target, *, constant=None, extra_node=False, use_result=False
) -> torch.fx.GraphModule:
    """``target(q, k, v, out)`` as a submodule, with the variations a direct call must refuse."""
    graph = torch.fx.Graph()
    q, k, v, out = (graph.placeholder(name) for name in "qkvo")
    if extra_node:
        q = graph.call_function(torch.neg, (q,))
    args = (q, k, v, out) if constant is None else (q, k, constant, out)
    call = graph.call_function(target, args)
    graph.output(call if use_result else ())
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_the_call_gets_inputs_in_place(graph_platform):
    op = silly_attention_op()
    call = splitting_call(one_call_graph(op.default))
    assert isinstance(call, SplittingCall)
    q, k, v = (torch.full((2, 3), value) for value in (1.0, 2.0, 4.0))
    out = torch.zeros(2, 3)
    assert call(q, k, v, out) == ()
    assert torch.equal(out, torch.full((2, 3), 7.0))
    assert call.constants is not None  # every input in order: passed straight on


def test_inputs_out_of_order_or_by_keyword_are_gathered_per_call():
    calls = []

    def record(*args, **kwargs):
        calls.append((args, kwargs))

    swapped = SplittingCall(record, [("input", 1), ("input", 0)], {}, (), num_inputs=2)
    keyword = SplittingCall(record, [("input", 0)], {"b": ("input", 1)}, (), num_inputs=2)
    unused = SplittingCall(record, [("input", 0), ("constant", 5)], {}, (), num_inputs=2)
    assert (swapped.constants, keyword.constants, unused.constants) == (None, None, None)
    swapped("a", "b")
    keyword("a", "b")
    unused("a", "b")
    assert calls == [(("b", "a"), {}), (("a",), {"b": "b"}), (("a", 5), {})]


def test_what_keeps_its_graph_module(graph_platform, monkeypatch):
    op = silly_attention_op()
    assert splitting_call(one_call_graph(op.default, extra_node=True)) is None
    assert splitting_call(one_call_graph(op.default, use_result=True)) is None
    assert splitting_call(one_call_graph(op.default, constant=[1, 2])) is None
    assert splitting_call(one_call_graph(torch.ops.aten.add.Tensor)) is None  # not ours
    implementation, _ = custom_op._implementations["silly::attention"]
    monkeypatch.setitem(
        custom_op._implementations, "silly::attention", (implementation, "SomeOtherKey")
    )
    assert splitting_call(one_call_graph(op.default)) is None  # registered for another key
