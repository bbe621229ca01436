"""A graph-inspecting Dynamo backend: pieceworks' passes on a real post-grad-style graph.

``run_with_passes(fn, args, passes)`` traces ``fn`` with Dynamo (dim 0 of every 2-D+ argument
is the dynamic token dimension, as in pieceworks' pieces, so shapes hold SymInts), functionalizes
and decomposes it with AOT autograd exactly as Inductor does before its post-grad passes
(Inductor's decomposition table, auto-functionalization v1, input mutations kept in the graph),
counts the ops, runs ``passes`` on the graph, counts again, and then runs the rewritten graph, with
no code generation. Seconds per call instead of Inductor's tens of seconds; the Inductor
end-to-end check is ``test_inductor_passes.py``.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch._dynamo.backends.common import aot_autograd
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table


def op_counts(graph: torch.fx.Graph) -> collections.Counter[str]:
    """``{"aten.view.default": 2, "auto_functionalized": 1, ...}`` over call_function nodes."""
    return collections.Counter(
        str(node.target) for node in graph.nodes if node.op == "call_function"
    )


@dataclasses.dataclass
class PassRun:
    """What the passes saw and left: op counts, the graph after, guards they added.

    ``compiled`` runs the rewritten graph again (other token counts reuse it: no recompile).
    """

    before: collections.Counter[str]
    after: collections.Counter[str]
    graph: torch.fx.Graph
    num_guards_added: int
    compiled: Callable[..., Any] | None = None


def run_with_passes(
    fn: Callable[..., Any], args: Sequence[Any], passes: Sequence[Callable[[torch.fx.Graph], None]]
) -> tuple[Any, PassRun]:
    """``fn(*args)`` compiled through the passes, and a record of what they did to the graph."""
    runs: list[PassRun] = []

    def inspect_and_run(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        shape_env = detect_fake_mode(example_inputs).shape_env
        num_guards = len(shape_env.guards)
        before = op_counts(gm.graph)
        for graph_pass in passes:
            graph_pass(gm.graph)
        gm.graph.lint()
        gm.recompile()
        added = len(shape_env.guards) - num_guards
        runs.append(PassRun(before, op_counts(gm.graph), gm.graph, added))
        return gm

    backend = aot_autograd(
        fw_compiler=inspect_and_run,
        decompositions=select_decomp_table(),
        keep_inference_input_mutations=True,
    )
    torch._dynamo.reset()
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() >= 2:
            torch._dynamo.mark_dynamic(arg, 0)  # the token dimension
    with torch._inductor.config.patch(enable_auto_functionalized_v2=False), torch.no_grad():
        compiled = torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)
        outputs = compiled(*args)
    assert len(runs) == 1, f"expected one graph, got {len(runs)}"
    runs[0].compiled = compiled
    return outputs, runs[0]
