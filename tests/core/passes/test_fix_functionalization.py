"""Fix-functionalization: pieceworks' mutating ops run in place again, with no extra copies.

A toy op registered through ``direct_register_custom_op`` writes ``2 * x`` into ``out``. Traced
inside a graph (``graph_backend``: auto-functionalization v1, as pieces compile), it arrives
wrapped in ``auto_functionalized``; after the pass the wrapper is gone, the raw op is called on
the original buffer, and neither a clone nor a write-back copy is left. Where a later node still
reads the buffer's old value the wrapper must stay; ops pieceworks did not register stay too. An op
that also returns a tensor runs in place and its node keeps the result's value (``meta["val"]``);
one with two results keeps both as items of the in-place call. An old value read through a view
keeps the wrapper too. Each call counts its rewrites and logs the count at debug level; a reader
of the wrapper that is not an item is refused, naming both nodes.
Run: pytest tests/core/passes/test_fix_functionalization.py
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch.fx.experimental.proxy_tensor import make_fx
from torch.library import Library

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.core.passes.fix_functionalization import FixFunctionalizationPass
from tests.core.passes.graph_backend import op_counts, run_with_passes

WRAPPER, RAW_OP = "auto_functionalized", "passes_toy.scale_into.default"
LOGGER = "pieceworks.core.passes.fix_functionalization"
COPIES = ("aten.clone.default", "aten.copy_.default", "aten.copy.default")
passes_toy_lib = Library("passes_toy", "FRAGMENT")


def _scale_into(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x * 2)


def _scale_into_fake(x: torch.Tensor, out: torch.Tensor) -> None:
    return None


def scale_into_op():
    return direct_register_custom_op(
        "scale_into",
        _scale_into,
        mutates_args=["out"],
        fake_impl=_scale_into_fake,
        target_lib=passes_toy_lib,
    )


def num_copies(counts) -> int:
    return sum(counts[name] for name in COPIES)


def test_op_writing_a_fresh_buffer_runs_in_place():
    op = scale_into_op()

    def piece(x):
        out = torch.empty_like(x)
        op(x, out)
        return out + 1

    x = torch.randn(5, 8)
    out, run = run_with_passes(piece, [x], [FixFunctionalizationPass()])
    assert (run.before[WRAPPER], run.before[RAW_OP]) == (1, 0)
    assert (run.after[WRAPPER], run.after[RAW_OP]) == (0, 1)
    assert num_copies(run.after) == 0
    torch.testing.assert_close(out, x * 2 + 1)


def test_mutated_graph_input_is_written_in_place_without_write_back():
    op = scale_into_op()

    def piece(x, buffer):
        op(x, buffer)
        return buffer * 3

    x, buffer = torch.randn(5, 8), torch.zeros(5, 8)
    out, run = run_with_passes(piece, [x, buffer], [FixFunctionalizationPass()])
    assert run.before[WRAPPER] == 1 and run.before["aten.copy_.default"] == 1  # the write-back
    assert (run.after[WRAPPER], run.after[RAW_OP]) == (0, 1)
    assert num_copies(run.after) == 0
    torch.testing.assert_close(buffer, x * 2)  # mutated, as eager mutates it
    torch.testing.assert_close(out, x * 6)


def test_two_ops_on_one_buffer_both_run_in_place():
    op = scale_into_op()

    def piece(x):
        out = torch.empty_like(x)
        op(x, out)
        op(out + 1, out)
        return out

    x = torch.randn(5, 8)
    out, run = run_with_passes(piece, [x], [FixFunctionalizationPass()])
    assert (run.before[WRAPPER], run.after[WRAPPER], run.after[RAW_OP]) == (2, 0, 2)
    torch.testing.assert_close(out, (x * 2 + 1) * 2)


def _traced(read_old_value_after: bool) -> torch.fx.GraphModule:
    """A functional graph in which ``buffer + 1`` (the old value) is read before or after."""
    op = scale_into_op().default

    def graph(x, buffer):
        old_plus_one = None if read_old_value_after else buffer + 1
        result = auto_functionalized(op, x=x, out=buffer)
        if read_old_value_after:
            old_plus_one = buffer + 1
        return result[1], old_plus_one

    return make_fx(graph, tracing_mode="symbolic")(torch.randn(5, 8), torch.zeros(5, 8))


def test_old_value_read_after_the_op_keeps_the_wrapper():
    for read_after, expected_wrappers in [(True, 1), (False, 0)]:
        gm = _traced(read_after)
        FixFunctionalizationPass()(gm.graph)
        gm.recompile()
        assert op_counts(gm.graph)[WRAPPER] == expected_wrappers
        x, buffer = torch.randn(5, 8), torch.zeros(5, 8)
        new_value, old_plus_one = gm(x, buffer)
        torch.testing.assert_close(new_value, x * 2)
        torch.testing.assert_close(old_plus_one, torch.ones(5, 8))  # read before the write


def test_ops_not_registered_by_pieceworks_are_left_alone():
    @torch.library.custom_op("passes_toy::foreign_scale_into", mutates_args=["out"])
    def foreign(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x * 2)

    def piece(x):
        out = torch.empty_like(x)
        foreign(x, out)
        return out

    x = torch.randn(5, 8)
    out, run = run_with_passes(piece, [x], [FixFunctionalizationPass()])
    assert run.after[WRAPPER] == run.before[WRAPPER] == 1  # Inductor will clone as usual
    torch.testing.assert_close(out, x * 2)


def _scale_into_and_sum(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    out.copy_(x * 2)
    return x.sum(0)


def _scale_into_and_sum_fake(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[1:])


def test_an_op_with_a_result_runs_in_place_and_its_node_keeps_the_results_value():
    """The in-place call's ``meta["val"]`` is the op's own result, as Inductor reads it."""
    op = direct_register_custom_op(
        "scale_into_and_sum",
        _scale_into_and_sum,
        mutates_args=["out"],
        fake_impl=_scale_into_and_sum_fake,
        target_lib=passes_toy_lib,
    )

    def piece(x):
        out = torch.empty_like(x)
        total = op(x, out)
        return out + 1, total

    x = torch.randn(5, 8)
    (out, total), run = run_with_passes(piece, [x], [FixFunctionalizationPass()])
    assert (run.before[WRAPPER], run.after[WRAPPER]) == (1, 0)
    (call,) = [
        node for node in run.graph.nodes if str(node.target).endswith("scale_into_and_sum.default")
    ]
    assert isinstance(call.meta["val"], torch.Tensor) and call.meta["val"].shape == (8,)
    torch.testing.assert_close(out, x * 2 + 1)
    torch.testing.assert_close(total, x.sum(0))


def test_the_rewrites_are_counted_and_logged(caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    fix = FixFunctionalizationPass()
    fix(_traced(read_old_value_after=False).graph)
    assert fix.num_rewrites == 1
    fix(_traced(read_old_value_after=True).graph)
    assert fix.num_rewrites == 0  # the last call's count
    messages = [
        r.getMessage() for r in {id(r): r for r in caplog.records if r.name == LOGGER}.values()
    ]
    assert messages == [
        "fix functionalization: 1 ops made in place",
        "fix functionalization: 0 ops made in place",
    ]


def test_an_old_value_read_through_a_view_keeps_the_wrapper():
    op = scale_into_op().default

    def graph(x, buffer):
        flat = buffer.view(-1)
        result = auto_functionalized(op, x=x, out=buffer)
        return result[1], flat + 1  # the view still holds the old value

    gm = make_fx(graph, tracing_mode="symbolic")(torch.randn(5, 8), torch.zeros(5, 8))
    fix = FixFunctionalizationPass()
    fix(gm.graph)
    assert (fix.num_rewrites, op_counts(gm.graph)[WRAPPER]) == (0, 1)


def test_a_user_other_than_an_item_is_refused_by_name():
    gm = _traced(read_old_value_after=False)
    (wrapper,) = [node for node in gm.graph.nodes if node.target is auto_functionalized]
    with gm.graph.inserting_after(wrapper):
        whole = gm.graph.call_function(len, (wrapper,))
    with pytest.raises(AssertionError) as refused:
        FixFunctionalizationPass()(gm.graph)
    assert str(refused.value) == f"unexpected user {whole.name} of {wrapper.name}"


def _split_into(x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out.copy_(x * 2)
    return x.sum(0), x.amax(0)


def _split_into_fake(x: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape[1:]), x.new_empty(x.shape[1:])


def test_an_op_with_two_results_keeps_both_and_the_buffer_s_readers_read_the_buffer():
    op = direct_register_custom_op(
        "split_into",
        _split_into,
        mutates_args=["out"],
        fake_impl=_split_into_fake,
        target_lib=passes_toy_lib,
    ).default

    def graph(x, buffer):
        total, peak, new_buffer = auto_functionalized(op, x=x, out=buffer)
        return total, peak, new_buffer * 3

    gm = make_fx(graph, tracing_mode="symbolic")(torch.randn(5, 8), torch.zeros(5, 8))
    fix = FixFunctionalizationPass()
    fix(gm.graph)
    gm.recompile()
    assert fix.num_rewrites == 1 and op_counts(gm.graph)[WRAPPER] == 0
    (call,) = [node for node in gm.graph.nodes if node.target is op]
    assert isinstance(call.meta["val"], tuple) and len(call.meta["val"]) == 2
    items = sorted(user.args[1] for user in call.users)
    assert items == [0, 1]
    x, buffer = torch.randn(5, 8), torch.zeros(5, 8)
    total, peak, tripled = gm(x, buffer)
    torch.testing.assert_close(total, x.sum(0))
    torch.testing.assert_close(peak, x.amax(0))
    torch.testing.assert_close(buffer, x * 2)  # written in place
    torch.testing.assert_close(tripled, x * 6)
