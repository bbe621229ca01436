"""``SplittingCall``: a splitting submodule's one op, called as its registered Python function.

Between two captured pieces the stitched module calls each splitting submodule (attention, the
Mamba2 mixer) eagerly, every step: a ``GraphModule`` whose forward calls the op through
``torch.ops``. That path runs ``nn.Module.__call__``, the generated forward and the dispatcher's
boxed call into Python before the op's body starts, host time paid once per layer per step in
every PIECEWISE step (``docs/performance.md``, "Small models, and every PIECEWISE step"). For a
submodule that is exactly one call of an op registered by ``direct_register_custom_op`` under
the current platform's dispatch key, the function the dispatcher would run is known, so the
stitched module calls it directly with the submodule's arguments and constants in place.

Anything else (several nodes, an op registered elsewhere or for another key, an output the
call would have to build) keeps its ``GraphModule``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx

from pieceworks.core.custom_op import registered_implementation
from pieceworks.core.split import op_qualified_name

# Where an argument of the op comes from: ("input", index of the submodule's argument) or
# ("constant", value).
ArgSource = tuple[str, Any]


class SplittingCall:
    """Calls ``implementation(*args, **kwargs)`` with the submodule's inputs in place and
    returns what the submodule returns (``()``: the op writes its output in place)."""

    def __init__(
        self,
        implementation: Callable[..., Any],
        args: list[ArgSource],
        kwargs: dict[str, ArgSource],
        result: Any,
        num_inputs: int | None = None,
    ) -> None:
        """``num_inputs``: how many inputs each call gets (the submodule's placeholders)."""
        self.implementation = implementation
        self.args = args
        self.kwargs = kwargs
        self.result = result
        # The usual shape (the attention op's): every input once, in order, then constants, no
        # keyword arguments. Then a call passes them straight on, with nothing to gather.
        in_order = [("input", i) for i in range(num_inputs or 0)]
        self.constants: tuple[Any, ...] | None = None
        tail = args[len(in_order) :]
        if (
            args[: len(in_order)] == in_order
            and not kwargs
            and all(k == "constant" for k, _ in tail)
        ):
            self.constants = tuple(value for _, value in tail)

    def __call__(self, *inputs: Any) -> Any:
        if self.constants is not None:
            self.implementation(*inputs, *self.constants)
            return self.result
        args = [inputs[v] if kind == "input" else v for kind, v in self.args]
        kwargs = {k: inputs[v] if kind == "input" else v for k, (kind, v) in self.kwargs.items()}
        self.implementation(*args, **kwargs)
        return self.result


def splitting_call(module: torch.fx.GraphModule) -> SplittingCall | None:
    """The direct call of ``module``'s op, or None when ``module`` is not exactly one call of an
    op with a known implementation on this platform that returns nothing the graph uses."""
    nodes = list(module.graph.nodes)
    placeholders = [node for node in nodes if node.op == "placeholder"]
    calls = [node for node in nodes if node.op == "call_function"]
    outputs = [node for node in nodes if node.op == "output"]
    if len(calls) != 1 or len(placeholders) + 2 != len(nodes) or len(outputs) != 1:
        return None
    call, (output,) = calls[0], outputs
    if output.args[0] not in ((), None) or call.users:
        return None  # the stitched module would read the op's result
    qualname = op_qualified_name(call.target)
    implementation = registered_implementation(qualname) if qualname else None
    if implementation is None:
        return None
    index = {node: i for i, node in enumerate(placeholders)}
    sources = [_source(arg, index) for arg in (*call.args, *call.kwargs.values())]
    if any(source is None for source in sources):
        return None
    args = sources[: len(call.args)]
    kwargs = dict(zip(call.kwargs, sources[len(call.args) :], strict=True))
    return SplittingCall(
        implementation,
        args,  # type: ignore[arg-type]
        kwargs,  # type: ignore[arg-type]
        output.args[0],
        num_inputs=len(placeholders),
    )


def _source(arg: Any, index: dict[torch.fx.Node, int]) -> ArgSource | None:
    """Where one argument comes from; None for anything but an input or a plain constant."""
    if isinstance(arg, torch.fx.Node):
        return ("input", index[arg]) if arg in index else None
    if arg is None or isinstance(arg, (bool, int, float, str)):
        return ("constant", arg)
    return None


def bind_splitting_calls(split_gm: torch.fx.GraphModule) -> int:
    """Shadow every splitting submodule of ``split_gm`` that allows it with its direct call (on
    the instance, as the compiled pieces are; the registered submodules stay, so the stitched
    module still pickles as its graph); how many."""
    bound = 0
    for name, module in split_gm.named_children():
        if isinstance(module, torch.fx.GraphModule) and name not in split_gm.__dict__:
            call = splitting_call(module)
            if call is not None:
                split_gm.__dict__[name] = call
                bound += 1
    return bound
