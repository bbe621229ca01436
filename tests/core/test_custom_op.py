"""``direct_register_custom_op``: the platform's dispatch key by default, and Dynamo traces the op;
a dynamic op called outside a capture gets its keyword arguments, and during a capture goes
through the capture guard with its qualified name; registered and dynamic ops are known by name;
an explicit dispatch key replaces the platform's, and the schema comes from the signature.

Run: pytest tests/core/test_custom_op.py
"""

from __future__ import annotations

import pytest
import torch
from torch.library import Library

from pieceworks.core import breakable_graph
from pieceworks.core.custom_op import (
    direct_register_custom_op,
    dynamic_ops,
    is_dynamic_op,
    is_registered_custom_op,
)
from pieceworks.platforms import current_platform

pytestmark = pytest.mark.platform_agnostic

_test_lib = Library("pieceworks_test_custom_op", "FRAGMENT")
_calls = {"count": 0}


def _scale_into(x: torch.Tensor, out: torch.Tensor) -> None:
    _calls["count"] += 1
    out.copy_(x * 2)


def _scale_into_fake(x: torch.Tensor, out: torch.Tensor) -> None:
    return None


def _register():
    return direct_register_custom_op(
        "scale_into",
        _scale_into,
        mutates_args=["out"],
        fake_impl=_scale_into_fake,
        target_lib=_test_lib,
    )


def test_registered_under_the_platform_dispatch_key():
    op = _register()
    key = current_platform().dispatch_key
    assert torch._C._dispatch_has_kernel_for_dispatch_key(
        "pieceworks_test_custom_op::scale_into", key
    )
    device = current_platform().device()
    out = torch.empty(3, device=device)
    op(torch.ones(3, device=device), out)
    assert torch.equal(out.cpu(), torch.full((3,), 2.0))


def test_registration_is_idempotent():
    assert _register() is _register()


def test_dynamo_traces_through_the_op_without_running_it():
    op = _register()
    seen_targets = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        seen_targets.extend(node.target for node in gm.graph.nodes if node.op == "call_function")
        return gm

    @torch.compile(backend=backend, fullgraph=True)
    def f(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        op(x + 1, out)
        return out * 3

    before = _calls["count"]
    result = f(torch.ones(4, device=current_platform().device()))
    assert torch.equal(result.cpu(), torch.full((4,), 12.0))
    assert _calls["count"] == before + 1  # ran once, at run time; tracing used the fake
    packet = torch.ops.pieceworks_test_custom_op.scale_into
    assert packet in seen_targets or packet.default in seen_targets


def _scale_by_into(x: torch.Tensor, out: torch.Tensor, *, factor: float = 2.0) -> None:
    out.copy_(x * factor)


def test_a_dynamic_op_outside_a_capture_passes_its_keyword_arguments():
    scale_by = direct_register_custom_op(
        "scale_by_into",
        _scale_by_into,
        mutates_args=["out"],
        fake_impl=lambda x, out, *, factor=2.0: None,
        target_lib=_test_lib,
        dynamic=True,
    )
    device = current_platform().device()
    x, out = torch.ones(3, device=device), torch.empty(3, device=device)
    scale_by(x, out, factor=5.0)
    assert torch.equal(out.cpu(), torch.full((3,), 5.0))


def _negate_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(-x)


def _register_dynamic_negate():
    return direct_register_custom_op(
        "negate_into",
        _negate_into,
        mutates_args=["out"],
        target_lib=_test_lib,
        dynamic=True,
    )


def test_registered_ops_are_known_and_dynamic_ones_listed():
    scale_into = _register()
    _register_dynamic_negate()
    assert is_registered_custom_op(scale_into.default)
    assert not is_registered_custom_op(torch.ops.aten.add.Tensor)
    assert is_dynamic_op("pieceworks_test_custom_op::negate_into")
    assert not is_dynamic_op("pieceworks_test_custom_op::scale_into")
    assert not is_dynamic_op("negate_into")
    listed = dynamic_ops()
    assert "pieceworks_test_custom_op::negate_into" in listed
    assert "pieceworks_test_custom_op::scale_into" not in listed
    assert listed == sorted(listed)


def test_a_dynamic_op_during_a_capture_goes_through_the_capture_guard(monkeypatch):
    negate = _register_dynamic_negate()
    seen = []

    def run_dynamic_op(name, op_func, args, kwargs):
        seen.append((name, op_func, args, kwargs))

    monkeypatch.setattr(breakable_graph, "active_capture", object())
    monkeypatch.setattr(breakable_graph, "run_dynamic_op", run_dynamic_op)
    device = current_platform().device()
    x, out = torch.ones(2, device=device), torch.zeros(2, device=device)
    negate(x, out)
    ((name, op_func, args, kwargs),) = seen
    assert (name, op_func, kwargs) == ("pieceworks_test_custom_op::negate_into", _negate_into, {})
    assert args[0] is x and args[1] is out
    assert torch.equal(out, torch.zeros_like(out))  # the guard decides; here it ran nothing
    monkeypatch.setattr(breakable_graph, "active_capture", None)
    negate(x, out)
    assert torch.equal(out, -x) and len(seen) == 1


def _offset_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x + 1)


def test_an_explicit_dispatch_key_is_used_instead_of_the_platform_s():
    offset = direct_register_custom_op(
        "offset_into",
        _offset_into,
        mutates_args=["out"],
        target_lib=_test_lib,
        dispatch_key="CompositeExplicitAutograd",
    )
    name = "pieceworks_test_custom_op::offset_into"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(name, current_platform().dispatch_key)
    out = torch.zeros(2)
    offset(torch.ones(2), out)
    assert torch.equal(out, torch.full((2,), 2.0))
    assert str(offset.default._schema) == f"{name}(Tensor x, Tensor(a1!) out) -> ()"
