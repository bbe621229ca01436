"""``GraphCall``: the record that replays a traced forward on a warm start, without Dynamo.

Proves, on hand-made records of a small module: every kind of graph input (a forward argument,
by position or keyword, a size, a stride or the storage offset of one, a parameter or buffer,
shared ones under their first name) is sourced and read back from a later call; the result is
rebuilt in the forward's structure from graph outputs, graph inputs and constants; the record
survives JSON; what cannot be replayed (an input of another source, one Dynamo left unnamed, an
argument that is not the one the graph got, a result leaf of no known origin, sources that do
not pair with the inputs, a forward of other arguments, a missing parameter) is refused with a
message that names it. And the helpers: a placeholder's Dynamo source, the module's state by
name, the forward's argument names and a call's arguments bound to them.
Run: pytest tests/core/test_graph_call.py
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.fx

from pieceworks.core.graph_call import (
    GraphCall,
    UnsupportedGraphCall,
    bind_arguments,
    forward_arg_names,
    named_state,
    source_name,
)


class Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((3,), 2.0))
        self.register_buffer("offset", torch.ones(3))

    def forward(self, x, residual=None, *, factor=1.0):
        local = x * self.weight  # a local: not an argument name
        return local + self.offset


class Shared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Scale()
        self.second = Scale()
        self.second.weight = self.first.weight  # one tensor under two names

    def forward(self, x):
        return self.second(self.first(x))


class Renamed(torch.nn.Module):
    def forward(self, y, residual=None, *, factor=1.0):
        return y


def record(module, sources, graph_inputs, graph_outputs, call, result) -> GraphCall:
    """The record, after a JSON round trip as the warm-start store keeps it."""
    made = GraphCall.record(module, sources, graph_inputs, graph_outputs, call, result)
    return GraphCall.from_json(json.loads(json.dumps(made.to_json())))


def test_every_kind_of_input_is_sourced_and_read_from_a_later_call():
    module = Scale()
    x = torch.ones(4, 3)[:, :2]  # strides (3, 1): a stride is not a size
    residual = torch.zeros(4, 2)
    sources = [
        "L['x']",
        "L['x'].size()[0]",
        "L['x'].stride()[0]",
        "L['x'].storage_offset()",
        "L['residual']",
        "L['self']._parameters['weight']",
        "L['self']._buffers['offset']",
    ]
    graph_inputs = [x, 4, 3, 0, residual, module.weight, module.offset]
    call = record(module, sources, graph_inputs, (), ((x,), {"residual": residual}), None)
    assert call.arg_names == ("x", "residual", "factor")
    assert call.inputs == (
        ("arg", "x"),
        ("size", ("x", 0)),
        ("stride", ("x", 0)),
        ("storage_offset", "x"),
        ("arg", "residual"),
        ("state", "weight"),
        ("state", "offset"),
    )
    seen = []
    bound = call.bind(module, lambda *inputs: seen.append(inputs) or ())
    later = torch.ones(7, 5)[1:, 1:4]  # 6 rows, strides (5, 1), storage offset 6
    later_residual = torch.zeros(6, 3)
    bound(later, residual=later_residual)
    (inputs,) = seen
    assert inputs[0] is later and inputs[4] is later_residual
    assert inputs[1:4] == (6, 5, 6)
    assert inputs[5] is module.weight and inputs[6] is module.offset


def test_the_result_is_rebuilt_from_outputs_inputs_and_constants():
    module = Scale()
    x, out = torch.ones(2, 3), torch.zeros(2, 3)
    result = {"hidden": out, "input": x, "extra": (None, True, 3, 0.5, "tag")}
    call = record(module, ["L['x']"], [x], (out,), ((x,), {}), result)
    assert call.output_leaves == (
        ("output", 0),
        ("input", 0),
        ("constant", None),
        ("constant", True),
        ("constant", 3),
        ("constant", 0.5),
        ("constant", "tag"),
    )
    computed = torch.full((5, 3), 7.0)
    later = torch.ones(5, 3)
    replayed = call.bind(module, lambda inputs: [computed])(later)
    assert replayed.keys() == result.keys()
    assert replayed["hidden"] is computed and replayed["input"] is later
    assert replayed["extra"] == (None, True, 3, 0.5, "tag")


def test_a_shared_parameter_is_sourced_under_its_first_name():
    module = Shared()
    x = torch.ones(3)
    source = "L['self']._modules['second']._parameters['weight']"
    call = record(module, [source], [module.second.weight], (), ((x,), {}), None)
    assert call.inputs == (("state", "first.weight"),)
    assert [name for name, _ in named_state(module)] == [
        "first.weight",
        "second.weight",
        "first.offset",
        "second.offset",
    ]


def test_inputs_it_cannot_replay_are_refused_by_name():
    module = Scale()
    x = torch.ones(3)
    with pytest.raises(UnsupportedGraphCall) as global_input:
        GraphCall.record(module, ["G['table']"], [torch.ones(1)], (), ((x,), {}), None)
    assert str(global_input.value) == (
        "graph input G['table'] (Tensor) is neither a forward argument, a size of one, nor a "
        "parameter or buffer of the module"
    )
    with pytest.raises(UnsupportedGraphCall) as unnamed:
        GraphCall.record(module, [None], [2], (), ((x,), {}), None)
    assert str(unnamed.value) == (
        "graph input ? (int) is neither a forward argument, a size of one, nor a parameter or "
        "buffer of the module"
    )
    # The argument's name, but not the tensor the call passed (a copy the forward made).
    with pytest.raises(UnsupportedGraphCall, match=r"^graph input L\['x'\] \(Tensor\) is"):
        GraphCall.record(module, ["L['x']"], [x.clone()], (), ((x,), {}), None)
    # An argument the call left out (its default) is no source either.
    with pytest.raises(UnsupportedGraphCall, match=r"^graph input L\['residual'\] \(NoneType\)"):
        GraphCall.record(module, ["L['residual']"], [None], (), ((x,), {}), None)
    with pytest.raises(UnsupportedGraphCall) as unpaired:
        GraphCall.record(module, ["L['x']", "L['x']"], [x], (), ((x,), {}), None)
    assert str(unpaired.value) == "the graph's inputs and their sources do not pair up"


def test_a_result_of_no_known_origin_is_refused():
    module = Scale()
    x = torch.ones(3)
    with pytest.raises(UnsupportedGraphCall) as refused:
        GraphCall.record(module, ["L['x']"], [x], (), ((x,), {}), [x, torch.zeros(1)])
    assert str(refused.value) == (
        "the forward returns a Tensor that is neither a graph output, a graph input nor a constant"
    )
    with pytest.raises(UnsupportedGraphCall, match="^the forward returns a slice that"):
        GraphCall.record(module, ["L['x']"], [x], (), ((x,), {}), {"ids": slice(2)})


def test_binding_refuses_another_forward_or_missing_state():
    module = Scale()
    x = torch.ones(3)
    call = record(module, ["L['self']._parameters['weight']"], [module.weight], (), ((x,), {}), 1)
    with pytest.raises(UnsupportedGraphCall) as renamed:
        call.bind(Renamed(), lambda *inputs: ())
    assert str(renamed.value) == "the forward's arguments differ from the traced ones"
    smaller = Scale()
    del smaller._parameters["weight"]
    with pytest.raises(UnsupportedGraphCall) as missing:
        call.bind(smaller, lambda *inputs: ())
    assert str(missing.value) == "the module has no parameter or buffer weight"
    assert call.bind(module, lambda *inputs: ())(x) == 1


def test_a_placeholder_s_source_is_dynamo_s_name_or_none():
    graph = torch.fx.Graph()
    placeholder = graph.placeholder("x")
    assert source_name(placeholder) is None
    placeholder.meta["grapharg"] = SimpleNamespace(source=None)
    assert source_name(placeholder) is None
    placeholder.meta["grapharg"] = SimpleNamespace(source=SimpleNamespace(name="L['x']"))
    assert source_name(placeholder) == "L['x']"
    placeholder.meta["grapharg"] = SimpleNamespace(source=SimpleNamespace(name=lambda: "L['y']"))
    assert source_name(placeholder) == "L['y']"


def test_the_forward_s_arguments_by_name():
    assert forward_arg_names(Scale.forward) == ("x", "residual", "factor")
    x = torch.ones(1)
    assert bind_arguments(("x", "residual", "factor"), (x,), {"factor": 2.0}) == {
        "x": x,
        "factor": 2.0,
    }
    assert bind_arguments(("x", "residual"), (x, None), {}) == {"x": x, "residual": None}
