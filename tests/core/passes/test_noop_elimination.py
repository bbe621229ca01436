"""No-op elimination: reshape chains fold, identity reshapes/slices go, SymInt-aware, no guards.

Each test traces a small function whose token dimension is symbolic (``graph_backend``), counts
the view and slice ops before and after ``NoOpEliminationPass`` and checks the outputs against
eager. Shapes that are equal only for some token counts must be left alone, and the pass must
never add a guard on the token count. On a hand-built graph, views of a ``reshape`` fold into a
``reshape`` of the base (it may have to copy), and each fold is counted; each call logs its
count at debug level.
Run: pytest tests/core/passes/test_noop_elimination.py
"""

from __future__ import annotations

import logging

import pytest
import torch

from pieceworks.core.passes.noop_elimination import NoOpEliminationPass
from tests.core.passes.graph_backend import run_with_passes

VIEW, SLICE = "aten.view.default", "aten.slice.Tensor"


def tokens(num_tokens: int = 5, hidden: int = 16) -> torch.Tensor:
    return torch.randn(num_tokens, hidden)


def test_reshape_chain_becomes_one_reshape_of_the_base():
    def chain(x):
        return x.reshape(-1, 4, 4).reshape(-1, 2, 8).reshape(-1, 8, 2) + 1

    x = tokens()
    out, run = run_with_passes(chain, [x], [NoOpEliminationPass()])
    assert run.before[VIEW] == 3
    assert run.after[VIEW] == 1  # one reshape, of x itself
    (view,) = [n for n in run.graph.nodes if str(n.target) == VIEW]
    assert view.args[0].op == "placeholder"
    torch.testing.assert_close(out, chain(x))
    assert run.num_guards_added == 0


def test_reshapes_to_the_input_shape_are_removed_with_symbolic_tokens():
    def identities(x):
        y = x.reshape(-1, x.shape[-1])  # (T, 16) -> (T, 16): what the FP8 linear adds
        z = y.view(y.shape[0], 16).reshape(x.shape)
        return z * 2, x.reshape(-1, 8)  # the second reshape changes the shape: kept

    x = tokens()
    out, run = run_with_passes(identities, [x], [NoOpEliminationPass()])
    assert run.before[VIEW] >= 3
    assert run.after[VIEW] == 1
    for actual, expected in zip(out, identities(x)):
        torch.testing.assert_close(actual, expected)
    assert run.num_guards_added == 0


def test_full_width_slices_are_removed_partial_ones_kept():
    def slices(x):
        full_width = x[:, :16]
        all_tokens = x[: x.shape[0]]
        partial = x[:, :8]
        return full_width + all_tokens, partial * 2

    x = tokens()
    out, run = run_with_passes(slices, [x], [NoOpEliminationPass()])
    assert run.before[SLICE] == 4  # x[:, a:b] is a full slice of dim 0, then one of dim 1
    assert run.after[SLICE] == 1  # x[:, :8]'s slice of dim 1
    for actual, expected in zip(out, slices(x)):
        torch.testing.assert_close(actual, expected)


def test_slice_to_another_symbolic_size_is_kept_and_guards_nothing():
    """``x[:n]`` with n another tensor's token count equals x only when the counts agree."""

    def slice_to_other(x, y):
        return x[: y.shape[0]] * 2

    x, y = tokens(6), tokens(6)
    out, run = run_with_passes(slice_to_other, [x, y], [NoOpEliminationPass()])
    assert run.after[SLICE] == run.before[SLICE] == 1
    assert run.num_guards_added == 0
    torch.testing.assert_close(out, x * 2)


def test_full_slice_scatter_is_its_source():
    def scatter(x):
        return torch.slice_scatter(x, x * 3, dim=1, start=0, end=16) + 1

    x = tokens()
    out, run = run_with_passes(scatter, [x], [NoOpEliminationPass()])
    assert run.before["aten.slice_scatter.default"] == 1
    assert run.after["aten.slice_scatter.default"] == 0
    torch.testing.assert_close(out, x * 3 + 1)


def test_slice_scatter_of_independent_token_counts_is_kept():
    """Source and destination have separate symbolic token counts: not provably the same shape."""

    def scatter(x, src):
        return torch.slice_scatter(x, src, dim=1, start=0, end=16) + 1

    x, src = tokens(), tokens()
    out, run = run_with_passes(scatter, [x, src], [NoOpEliminationPass()])
    assert run.after["aten.slice_scatter.default"] == 1
    assert run.num_guards_added == 0
    torch.testing.assert_close(out, src + 1)


@pytest.mark.parametrize("num_tokens", [1, 7])
def test_rewritten_graph_serves_other_token_counts(num_tokens):
    """The folded graph is still the general-shape graph: other token counts run through it."""

    def chain(x):
        return x.reshape(-1, 4, 4).reshape(-1, 16)[:, :16].sum(-1)

    _, run = run_with_passes(chain, [tokens(5)], [NoOpEliminationPass()])
    assert run.compiled is not None
    x = tokens(num_tokens)
    with torch.no_grad():
        torch.testing.assert_close(run.compiled(x), x.sum(-1))


def test_views_of_a_reshape_become_one_reshape_of_the_base_and_each_fold_counts():
    """The folded op may have to copy as the inner ``reshape`` could: it is a reshape too."""
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    inner = graph.call_function(aten.reshape.default, (x, [-1, 4, 4]))
    middle = graph.call_function(aten.view.default, (inner, [-1, 8, 2]))
    graph.output(graph.call_function(aten.view.default, (middle, [-1, 2, 8])))
    noop = NoOpEliminationPass()
    noop(graph)
    assert noop.num_rewrites == 2  # two reshapes folded away
    (folded,) = [node for node in graph.nodes if node.op == "call_function"]
    assert folded.target is aten.reshape.default and folded.args == (x, [-1, 2, 8])
    transposed = torch.randn(16, 4).t()  # not contiguous: a view of it to (-1, 2, 8) fails
    out = torch.fx.GraphModule(torch.nn.Module(), graph)(transposed)
    torch.testing.assert_close(out, transposed.reshape(-1, 2, 8))


def test_each_call_logs_its_rewrites_at_debug(caplog, monkeypatch):
    logger = "pieceworks.core.passes.noop_elimination"
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    caplog.set_level(logging.DEBUG, logger=logger)
    elimination = NoOpEliminationPass()
    run_with_passes(lambda x: x.reshape(-1, 16) + 1, [tokens()], [elimination])
    assert elimination.num_rewrites == 1
    run_with_passes(lambda x: x + 2, [tokens()], [elimination])
    assert elimination.num_rewrites == 0
    records = {id(r): r for r in caplog.records if r.name == logger}.values()
    assert [r.getMessage() for r in records] == [
        "no-op elimination: 1 rewrites",
        "no-op elimination: 0 rewrites",
    ]
