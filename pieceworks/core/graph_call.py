"""``GraphCall``: how a forward's arguments and its module's state become the traced graph's
inputs, and the graph's outputs the forward's result.

On a traced start Dynamo's transformed bytecode does this: it reads each graph input from where
Dynamo found it while tracing (a forward argument, a size of one, a parameter of the module) and
returns the graph's outputs in the forward's own structure. A warm start (``warm_start.py``) runs
no trace and so has no bytecode; this record stands in for it. It is made on the traced first call
from what the compiled graph really received and returned, and from each graph input's Dynamo
source (``L['input_ids']``, ``L['input_ids'].size()[0]``, ``L['self']._modules[...]``): every
input must be a forward argument, a size, stride or storage offset of one, or a parameter or
buffer of the module; every leaf of the result a graph output, a graph input or a constant.
Anything else (a global tensor, an attribute that is not registered state) raises
``UnsupportedGraphCall`` and the model simply keeps tracing on every start.

Parameters and buffers are bound once, when the warm start is built, exactly as static graphs
bind their addresses: a model that replaces a parameter object after its first call must trace.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

# L['name'], L['name'].size()[d], L['name'].stride()[d], L['name'].storage_offset()
_ARG_SOURCE = re.compile(r"L\['(\w+)'\](?:\.(size|stride)\(\)\[(\d+)\]|\.(storage_offset)\(\))?$")
_CONSTANT_TYPES = (type(None), bool, int, float, str)


class UnsupportedGraphCall(Exception):
    """The traced call cannot be replayed without Dynamo's bytecode; the message says why."""


def source_name(placeholder: torch.fx.Node) -> str | None:
    """The Dynamo source of a graph input (``L['x'].size()[0]``); None when Dynamo left none."""
    graph_arg = placeholder.meta.get("grapharg")
    source = getattr(graph_arg, "source", None)
    if source is None:
        return None
    name = source.name
    return name() if callable(name) else name  # a method in older torch, a property in newer


def named_state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` by qualified name, shared ones under each name."""
    state: list[tuple[str, torch.Tensor]] = [*module.named_parameters(remove_duplicate=False)]
    return state + [*module.named_buffers(remove_duplicate=False)]


def forward_arg_names(forward: Callable[..., Any]) -> tuple[str, ...]:
    """The forward's parameter names after ``self``, in order."""
    code = forward.__code__
    return code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount]


def bind_arguments(names: Sequence[str], args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The forward's arguments by name (defaults the call left out are absent)."""
    values = dict(zip(names, args, strict=False))
    values.update(kwargs)
    return values


def _input_getter(
    name: str | None, value: Any, state_names: dict[int, str], arguments: dict[str, Any]
) -> tuple[str, Any]:
    """Where one graph input comes from: (kind, payload); raises if it is not replayable."""
    match = _ARG_SOURCE.match(name or "")
    if match is not None and match.group(1) in arguments:
        arg, prop, dim, offset = match.groups()
        if prop is not None:
            return (prop, (arg, int(dim)))
        if offset is not None:
            return ("storage_offset", arg)
        if value is arguments[arg]:
            return ("arg", arg)
    if isinstance(value, torch.Tensor) and id(value) in state_names:
        return ("state", state_names[id(value)])
    raise UnsupportedGraphCall(
        f"graph input {name or '?'} ({type(value).__name__}) is neither a forward argument, a "
        "size of one, nor a parameter or buffer of the module"
    )


def _output_leaf(value: Any, graph_outputs: Sequence[Any], graph_inputs: Sequence[Any]) -> tuple:
    """Where one leaf of the forward's result comes from: (kind, payload)."""
    for kind, values in (("output", graph_outputs), ("input", graph_inputs)):
        for index, candidate in enumerate(values):
            if candidate is value:
                return (kind, index)
    if isinstance(value, _CONSTANT_TYPES):
        return ("constant", value)
    raise UnsupportedGraphCall(
        f"the forward returns a {type(value).__name__} that is neither a graph output, a graph "
        "input nor a constant"
    )


@dataclasses.dataclass(frozen=True)
class GraphCall:
    """The inputs of the graph by source and the forward's result by graph output (JSON-ready)."""

    arg_names: tuple[str, ...]
    inputs: tuple[tuple[str, Any], ...]  # per graph input: ("arg", name), ("state", fqn), ...
    output_leaves: tuple[tuple[str, Any], ...]  # per result leaf: ("output", i), ("constant", v)
    output_spec: str  # the result's structure, torch.utils._pytree.treespec_dumps

    @classmethod
    def record(
        cls,
        module: torch.nn.Module,
        source_names: Sequence[str | None],
        graph_inputs: Sequence[Any],
        graph_outputs: Sequence[Any],
        call: tuple[tuple, dict[str, Any]],
        result: Any,
    ) -> GraphCall:
        """The record of one traced call: what the graph got and returned, what forward gave."""
        arg_names = forward_arg_names(type(module).forward)
        arguments = bind_arguments(arg_names, *call)
        state_names: dict[int, str] = {}
        for fqn, tensor in named_state(module):
            state_names.setdefault(id(tensor), fqn)
        if len(source_names) != len(graph_inputs):
            raise UnsupportedGraphCall("the graph's inputs and their sources do not pair up")
        inputs = tuple(
            _input_getter(name, value, state_names, arguments)
            for name, value in zip(source_names, graph_inputs, strict=True)
        )
        leaves, spec = pytree.tree_flatten(result)
        output_leaves = tuple(_output_leaf(leaf, graph_outputs, graph_inputs) for leaf in leaves)
        return cls(arg_names, inputs, output_leaves, pytree.treespec_dumps(spec))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> GraphCall:
        return cls(
            tuple(payload["arg_names"]),
            tuple((kind, _tuple(value)) for kind, value in payload["inputs"]),
            tuple((kind, value) for kind, value in payload["output_leaves"]),
            payload["output_spec"],
        )

    def bind(self, module: torch.nn.Module, runnable: Callable[..., Any]) -> BoundGraphCall:
        """The forward of ``module`` replayed through ``runnable`` (the loaded graph)."""
        if forward_arg_names(type(module).forward) != self.arg_names:
            raise UnsupportedGraphCall("the forward's arguments differ from the traced ones")
        state = dict(named_state(module))
        missing = [fqn for kind, fqn in self.inputs if kind == "state" and fqn not in state]
        if missing:
            raise UnsupportedGraphCall(f"the module has no parameter or buffer {missing[0]}")
        return BoundGraphCall(self, state, runnable)


def _tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value  # JSON turns tuples into lists


class BoundGraphCall:
    """Calls the loaded graph as Dynamo's bytecode would: inputs gathered, result rebuilt."""

    def __init__(
        self, call: GraphCall, state: dict[str, torch.Tensor], runnable: Callable[..., Any]
    ) -> None:
        self.arg_names = call.arg_names
        self.runnable = runnable
        # The state tensors, bound once; None where the input comes from the call. Only the
        # few inputs taken from the call are visited per call (a model has hundreds of weights).
        self.bound = [state[fqn] if kind == "state" else None for kind, fqn in call.inputs]
        self.from_call = [
            (i, kind, src) for i, (kind, src) in enumerate(call.inputs) if kind != "state"
        ]
        self.output_leaves = call.output_leaves
        self.output_spec = pytree.treespec_loads(call.output_spec)

    def graph_inputs(self, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
        arguments = bind_arguments(self.arg_names, args, kwargs)
        values = self.bound.copy()
        for index, kind, source in self.from_call:
            if kind == "arg":
                values[index] = arguments[source]
            elif kind == "size":
                values[index] = arguments[source[0]].size(source[1])
            elif kind == "stride":
                values[index] = arguments[source[0]].stride(source[1])
            else:  # storage_offset
                values[index] = arguments[source].storage_offset()
        return values

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inputs = self.graph_inputs(args, kwargs)
        outputs = self.runnable(*inputs)
        leaves = [
            outputs[payload]
            if kind == "output"
            else inputs[payload]
            if kind == "input"
            else payload
            for kind, payload in self.output_leaves
        ]
        return pytree.tree_unflatten(leaves, self.output_spec)
