"""``artifact_key`` on hand-built FX graphs: what the key of a piece's structure tells apart.

Proves: two pieces that differ only in node names share a key; another runtime shape, another
input dtype or shape, and another type of a non-tensor input (an int, a float) each give another
key; a piece that reads a constant (``get_attr``) is keyed by its index too; pieces wired
differently (``x - y``, ``y - x``) have different keys; an input described by ``val`` alone is
keyed by it; the key is the hash of one line per node (op, qualified target, arguments by
position, input description) after the runtime shape; an input's device and a symbolic size are
part of it; a target with no stable name (a lambda) is keyed by the piece's index too, and a
method call by the method's name.
Run: pytest tests/core/cache/test_artifact_key.py
"""

from __future__ import annotations

import hashlib
import operator

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from pieceworks.core.cache.artifact_key import artifact_key


def piece(value, name: str = "x") -> torch.fx.GraphModule:
    """``x * 2`` of one placeholder named ``name`` whose example value is ``value``."""
    graph = torch.fx.Graph()
    x = graph.placeholder(name)
    x.meta["example_value"] = value
    graph.output(graph.call_function(operator.mul, (x, 2)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_pieces_that_differ_only_in_names_share_a_key():
    tensor = torch.empty(4, 8)
    first, second = piece(tensor, "x_2"), piece(tensor, "x_4")
    assert artifact_key(first, None, 0) == artifact_key(second, None, 1)


def test_the_runtime_shape_and_each_input_property_change_the_key():
    key = artifact_key(piece(torch.empty(4, 8)), None, 0)
    assert artifact_key(piece(torch.empty(4, 8)), 4, 0) != key
    assert artifact_key(piece(torch.empty(4, 8, dtype=torch.float16)), None, 0) != key
    assert artifact_key(piece(torch.empty(8, 4)), None, 0) != key
    assert artifact_key(piece(torch.empty(8, 4).t()), None, 0) != key  # another stride


def test_a_non_tensor_input_is_keyed_by_its_type():
    assert artifact_key(piece(2), None, 0) == artifact_key(piece(3), None, 0)
    assert artifact_key(piece(2), None, 0) != artifact_key(piece(2.0), None, 0)


def test_a_piece_reading_a_constant_is_keyed_by_its_index():
    def with_constant() -> torch.fx.GraphModule:
        module = torch.nn.Module()
        module.register_buffer("table", torch.ones(3))
        graph = torch.fx.Graph()
        graph.output(graph.get_attr("table"))
        return torch.fx.GraphModule(module, graph)

    assert artifact_key(with_constant(), None, 0) != artifact_key(with_constant(), None, 1)
    assert artifact_key(piece(2), None, 0) == artifact_key(piece(2), None, 1)


def difference(first: str, second: str, meta: str = "example_value") -> torch.fx.GraphModule:
    """``first - second`` of placeholders ``x`` and ``y`` (4 x 8 example values under ``meta``)."""
    graph = torch.fx.Graph()
    inputs = {name: graph.placeholder(name) for name in ("x", "y")}
    for node in inputs.values():
        node.meta[meta] = torch.empty(4, 8)
    graph.output(graph.call_function(operator.sub, (inputs[first], inputs[second])))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_pieces_wired_differently_have_different_keys():
    # The same nodes and inputs, the operands swapped: x - y and y - x must not share an artifact.
    assert artifact_key(difference("x", "y"), None, 0) != artifact_key(
        difference("y", "x"), None, 0
    )
    assert artifact_key(difference("x", "y"), None, 0) == artifact_key(
        difference("x", "y"), None, 1
    )


def test_an_input_described_by_val_alone_is_keyed_by_it():
    # A graph whose placeholders carry only ``val`` (no ``example_value``) is keyed by that value.
    keyed_by_val = artifact_key(difference("x", "y", meta="val"), None, 0)
    assert keyed_by_val == artifact_key(difference("x", "y"), None, 0)
    untyped = difference("x", "y", meta="unused")
    assert keyed_by_val != artifact_key(untyped, None, 0)


def test_the_key_hashes_each_node_s_op_target_arguments_and_input_description():
    # The lines the key hashes, as a reader of a cache directory would rebuild them.
    lines = [
        "runtime_shape=8",
        "placeholder  ((), {}) torch.float32 (4, 8) (8, 1) cpu",
        "call_function _operator.mul (('%0', 2), {}) ",
        "output output (('%1',), {}) ",
    ]
    expected = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]
    assert artifact_key(piece(torch.empty(4, 8)), 8, 0) == expected


def test_the_device_and_a_symbolic_size_are_part_of_an_input_s_description():
    key = artifact_key(piece(torch.empty(4, 8)), None, 0)
    assert artifact_key(piece(torch.empty(4, 8, device="meta")), None, 0) != key
    shape_env = ShapeEnv()
    first, second = (shape_env.create_unbacked_symint() for _ in range(2))
    assert artifact_key(piece(first), None, 0) != artifact_key(piece(second), None, 0)
    assert artifact_key(piece(first), None, 0) != artifact_key(piece(4), None, 0)


def calling(target, op: str = "call_function") -> torch.fx.GraphModule:
    """``target(x)`` of one 4 x 8 placeholder, as a call of ``op``."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["example_value"] = torch.empty(4, 8)
    graph.output(graph.create_node(op, target, (x,)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def scaled_by(factor: float):
    """A local function: every one is named ``scaled`` in this module, whatever its factor."""

    def scaled(x):
        return x * factor

    return scaled


def test_a_target_with_no_stable_name_is_keyed_by_the_piece_s_index():
    # Two lambdas of one name, and two local functions of one name, that compute different
    # things: FX gives each pair one qualified name, so only the index keeps them apart.
    first = lambda x: x * 2  # noqa: E731
    halve = first
    first = lambda x: x * 0.5  # noqa: E731
    assert artifact_key(calling(halve), None, 0) != artifact_key(calling(first), None, 1)
    assert artifact_key(calling(first), None, 0) != artifact_key(calling(first), None, 1)
    double, triple = scaled_by(2.0), scaled_by(3.0)
    assert artifact_key(calling(double), None, 0) != artifact_key(calling(triple), None, 1)
    assert artifact_key(calling(torch.neg), None, 0) == artifact_key(calling(torch.neg), None, 1)
    assert artifact_key(calling(torch.neg), None, 0) != artifact_key(calling(torch.abs), None, 0)


def test_a_method_call_is_keyed_by_the_method_s_name():
    neg = artifact_key(calling("neg", "call_method"), None, 0)
    assert neg == artifact_key(calling("neg", "call_method"), None, 1)
    assert neg != artifact_key(calling("abs", "call_method"), None, 0)
