"""``direct_register_custom_op``: register an opaque op in pieceworks' ``torch.library`` namespace.

Opaque ops (attention and the Mamba2 mixer, where the graph is split; the tensor-parallel
all-reduce, which is traced into the pieces and captured with them) are registered here. Each gets a
fake implementation so Dynamo can trace through it without running it. The default dispatch key is
the current platform's, so the call resolves the platform: register ops lazily (on first model
construction), never at import.

An op registered with ``dynamic=True`` has an execution plan that depends on the step's batch
(attention, the Mamba2 mixer): captured once, it would replay the capture's plan. Its implementation
is then guarded: while no static-graph capture is in progress the guard is one module-global test
and a call; during a capture it goes through ``breakable_graph.run_dynamic_op``, which breaks a
breakable capture at it (a splitting op) or refuses it by name (not a splitting op).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.library import Library

from pieceworks.core import breakable_graph
from pieceworks.core.config import LIBRARY_NAMESPACE

# One fragment library for every pieceworks op; "FRAGMENT" lets several modules add ops to it.
pieceworks_lib = Library(LIBRARY_NAMESPACE, "FRAGMENT")
_registered: set[tuple[str, str]] = set()
_dynamic_ops: set[str] = set()  # "<ns>::<name>" of the ops registered with dynamic=True
# "<ns>::<name>" -> (the function registered as its implementation, the dispatch key)
_implementations: dict[str, tuple[Callable[..., Any], str]] = {}


def _guarded(name: str, op_func: Callable[..., Any]) -> Callable[..., Any]:
    """``op_func``, sent through the capture guard while a static-graph capture is in progress."""

    def dynamic_op(*args: Any, **kwargs: Any) -> Any:
        if breakable_graph.active_capture is None:
            return op_func(*args, **kwargs)
        return breakable_graph.run_dynamic_op(name, op_func, args, kwargs)

    return dynamic_op


def direct_register_custom_op(
    op_name: str,
    op_func: Callable[..., Any],
    mutates_args: Sequence[str],
    fake_impl: Callable[..., Any] | None = None,
    target_lib: Library | None = None,
    dispatch_key: str | None = None,
    *,
    dynamic: bool = False,
) -> Callable[..., Any]:
    """Define ``<ns>::op_name`` from ``op_func``'s signature; idempotent per (namespace, name).

    ``dynamic``: the op's plan depends on the batch (see the module docstring); it must be a
    splitting op wherever pieces are captured. Returns the registered op
    (``torch.ops.<ns>.<op_name>``).
    """
    lib = target_lib or pieceworks_lib
    key = (lib.ns, op_name)
    if key not in _registered:
        if dispatch_key is None:
            from pieceworks.platforms import current_platform

            dispatch_key = current_platform().capabilities().dispatch_key
        schema = torch.library.infer_schema(op_func, mutates_args=mutates_args)
        lib.define(op_name + schema)
        qualname = f"{lib.ns}::{op_name}"
        implementation = _guarded(qualname, op_func) if dynamic else op_func
        lib.impl(op_name, implementation, dispatch_key)
        _implementations[qualname] = (implementation, dispatch_key)
        if dynamic:
            _dynamic_ops.add(qualname)
        if fake_impl is not None:
            lib._register_fake(op_name, fake_impl)
        _registered.add(key)
    return getattr(getattr(torch.ops, lib.ns), op_name)


def is_registered_custom_op(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` was registered through ``direct_register_custom_op`` (in any namespace)."""
    return (op.namespace, op._schema.name.split("::")[-1]) in _registered


def registered_implementation(qualname: str) -> Callable[..., Any] | None:
    """The Python function the dispatcher runs for ``"<ns>::<name>"`` on the current platform,
    when the op was registered here under the platform's dispatch key; else None (another
    platform's key, or an op registered elsewhere)."""
    from pieceworks.platforms import current_platform

    registered = _implementations.get(qualname)
    if registered is None or registered[1] != current_platform().capabilities().dispatch_key:
        return None
    return registered[0]


def is_dynamic_op(qualname: str) -> bool:
    """Whether ``"<ns>::<name>"`` was registered with ``dynamic=True``."""
    return qualname in _dynamic_ops


def dynamic_ops() -> list[str]:
    """Every op registered with ``dynamic=True`` so far, as ``"<ns>::<name>"``."""
    return sorted(_dynamic_ops)
