"""``support_torch_compile`` / ``ignore_torch_compile``: opt a module class into the pipeline.

The decorated class must be constructed as ``Cls(*, config: EngineConfig, prefix: str = "")``.
Dynamic dims come from ``forward``'s annotations (every ``torch.Tensor`` or
``Optional[torch.Tensor]`` argument: dim 0, the token dimension) or an explicit
``dynamic_arg_dims``. The class is not rebuilt or re-based: ``__init__`` and ``__call__`` are
wrapped, and each instance gets its own ``TraceOnceCompiler``.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from pieceworks.core.config import CompilationLevel
from pieceworks.core.counters import compilation_counter

if TYPE_CHECKING:
    from pieceworks.core.backend import PiecewiseCompileBackend
    from pieceworks.core.static_graph import StaticGraphWrapperBase

_T = TypeVar("_T", bound=type)
_COMPILE_ATTR = "_pieceworks_compile_enabled"


def _annotated_dynamic_dims(cls: type) -> dict[str, int]:
    hints = typing.get_type_hints(cls.forward)  # type: ignore[attr-defined]
    tensor_types = (torch.Tensor, typing.Optional[torch.Tensor])  # noqa: UP045 (runtime value)
    return {name: 0 for name, hint in hints.items() if name != "return" and hint in tensor_types}


def ignore_torch_compile(cls: _T) -> _T:
    """Opt a class (typically a subclass of a decorated one) out of compilation."""
    setattr(cls, _COMPILE_ATTR, False)
    return cls


def support_torch_compile(
    cls: _T | None = None, *, dynamic_arg_dims: dict[str, int | list[int]] | None = None
) -> Any:
    """Class decorator: the module traces once and runs through the compile pipeline."""

    def decorate(cls: _T) -> _T:
        dims = dynamic_arg_dims if dynamic_arg_dims is not None else _annotated_dynamic_dims(cls)
        if not dims:
            raise ValueError(
                f"support_torch_compile on {cls.__name__}: no dynamic dims. Annotate "
                "forward's tensor arguments as torch.Tensor or pass dynamic_arg_dims"
            )
        forward_params = inspect.signature(cls.forward).parameters  # type: ignore[attr-defined]
        for name in dims:
            if name not in forward_params:
                raise ValueError(
                    f"dynamic_arg_dims names {name!r}, which is not an argument of "
                    f"{cls.__name__}.forward"
                )
        _wrap_init(cls, dims)
        _wrap_call(cls)
        setattr(cls, _COMPILE_ATTR, True)
        return cls

    return decorate(cls) if cls is not None else decorate


def _wrap_init(cls: type, dims: Mapping[str, int | list[int]]) -> None:
    original_init = cls.__init__  # type: ignore[misc]

    def __init__(self: Any, *args: Any, config: Any, prefix: str = "", **kwargs: Any) -> None:
        original_init(self, *args, config=config, prefix=prefix, **kwargs)
        self._pieceworks_compiler = None
        self._pieceworks_dims = dims
        level = config.compilation_config.level
        if getattr(type(self), _COMPILE_ATTR) and level != CompilationLevel.NO_COMPILATION:
            from pieceworks.core.trace_once import TraceOnceCompiler

            compilation_counter.num_models_seen += 1
            self._pieceworks_compiler = TraceOnceCompiler(self, config, prefix)

    cls.__init__ = __init__  # type: ignore[misc]


def _mark_dynamic(
    forward: Callable[..., Any], dims: Mapping[str, int | list[int]], args: tuple, kwargs: dict
) -> None:
    bound = inspect.signature(forward).bind(*args, **kwargs)
    for name, dim in dims.items():
        value = bound.arguments.get(name)
        if isinstance(value, torch.Tensor):
            torch._dynamo.mark_dynamic(value, dim)


def _wrap_call(cls: type) -> None:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        compiler = self._pieceworks_compiler
        if compiler is None or torch.compiler.is_compiling():
            return self.forward(*args, **kwargs)
        if not compiler.is_ready:
            _mark_dynamic(self.forward, self._pieceworks_dims, args, kwargs)
        return compiler(*args, **kwargs)

    cls.__call__ = __call__  # type: ignore[method-assign]


def piecewise_backends(model: torch.nn.Module) -> list[PiecewiseCompileBackend]:
    """The level-3 ``PiecewiseCompileBackend`` of every compiled module in ``model``."""
    compilers = [getattr(module, "_pieceworks_compiler", None) for module in model.modules()]
    backends = [compiler.piecewise_backend for compiler in compilers if compiler is not None]
    return [backend for backend in backends if backend is not None]


def static_graph_wrappers(model: torch.nn.Module) -> list[StaticGraphWrapperBase]:
    """The static-graph wrappers the level-3 backends of ``model`` built around its pieces."""
    backends = piecewise_backends(model)
    return [wrapper for backend in backends for wrapper in backend.static_graph_wrappers]
