"""Compiler adaptors behind one interface: ``eager`` (the FX graph as is) and ``inductor``.

Inductor goes through ``torch._inductor.standalone_compile``: a compile whose artifact can be saved
and loaded (the compile cache builds on that). Autotuning is turned on only for static sizes,
where its cost is paid once for a shape that is reused on every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.fx

from pieceworks.core.counters import compilation_counter

# Inductor options for a piece compiled for one static token count.
STATIC_SIZE_OPTIONS = {"max_autotune": True, "coordinate_descent_tuning": True}


class CompilerInterface:
    """Compile one piece for the dynamic shape (``runtime_shape=None``) or a static size."""

    name = "base"

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        options: dict[str, Any],
        runtime_shape: int | None,
    ) -> Callable[..., Any]:
        raise NotImplementedError


class EagerAdaptor(CompilerInterface):
    """Runs the FX graph as is: fast to build, used by most tests."""

    name = "eager"

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        options: dict[str, Any],
        runtime_shape: int | None,
    ) -> Callable[..., Any]:
        compilation_counter.num_eager_compiles += 1
        return graph


class InductorAdaptor(CompilerInterface):
    """Inductor through ``standalone_compile`` (artifacts can be saved and loaded)."""

    name = "inductor"

    def compile(
        self,
        graph: torch.fx.GraphModule,
        example_inputs: list[Any],
        options: dict[str, Any],
        runtime_shape: int | None,
    ) -> Callable[..., Any]:
        from torch._inductor import standalone_compile

        config_patches = dict(options)
        if runtime_shape is not None:
            config_patches.update(STATIC_SIZE_OPTIONS)
        dynamic_shapes: Literal["from_tracing_context", "from_example_inputs"] = (
            "from_tracing_context" if runtime_shape is None else "from_example_inputs"
        )
        compilation_counter.num_inductor_compiles += 1
        return standalone_compile(
            graph,
            list(example_inputs),
            dynamic_shapes=dynamic_shapes,
            options={"config_patches": config_patches},
        )


def make_compiler(backend: str) -> CompilerInterface:
    adaptors = {"eager": EagerAdaptor, "inductor": InductorAdaptor}
    if backend not in adaptors:
        raise ValueError(f"compile backend {backend!r} unknown; use one of {sorted(adaptors)}")
    return adaptors[backend]()
