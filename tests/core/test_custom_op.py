"""``direct_register_custom_op``: the platform's dispatch key by default, and Dynamo traces the op;
a dynamic op called outside a capture gets its keyword arguments.

Run: pytest tests/core/test_custom_op.py
"""

from __future__ import annotations

import pytest
import torch
from torch.library import Library

from pieceworks.core.custom_op import direct_register_custom_op
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
