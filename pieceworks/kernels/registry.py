"""The registry of kernel implementations: every op and what implements it, process-wide.

Like the platform registry, this is a catalogue, not a decision: the built-in implementations
(``builtin.py``) enter it the first time it is read, and an out-of-tree platform adds its own with
``register_kernel`` when its plugin is imported (``docs/platforms.md``). Which implementation a
layer runs is decided per engine by its ``KernelChooser`` (``chooser.py``), which reads this
registry when the model is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from pieceworks.kernels.builtin import builtin_kernels
from pieceworks.kernels.implementation import KernelImpl, Supports

ANY_DEVICE = Supports()  # no requirement: runs on every platform and device, for every dtype
_REGISTRY: dict[str, list[KernelImpl]] = {}
_builtins_registered = False


def _add(entry: KernelImpl) -> None:
    implementations = [known for known in _REGISTRY.get(entry.op, []) if known.name != entry.name]
    _REGISTRY[entry.op] = sorted([*implementations, entry], key=lambda known: -known.priority)


def register_kernel(
    op: str,
    impl: Callable[..., Any] | None,
    *,
    name: str,
    supports: Supports = ANY_DEVICE,
    platform: str | None = None,
    priority: int | None = None,
    native: bool = False,
    jitted: bool = False,
) -> KernelImpl:
    """Register ``impl`` as implementation ``name`` of ``op``; returns the entry.

    ``platform``: shorthand for ``supports.platform`` (an out-of-tree platform registers its
    kernels for itself). An implementation registered for a platform outranks the built-in ones
    there unless ``priority`` says otherwise. Registering a name again replaces the entry.
    Engines built afterwards see it; an engine's choices, once made, stay as they are.
    """
    if platform is not None:
        supports = dataclasses.replace(supports, platform=platform)
    if priority is None:
        priority = 100 if supports.platform is not None else 0
    entry = KernelImpl(op, name, supports, impl, priority, native, jitted)
    _add(entry)
    return entry


def unregister_kernel(op: str, name: str) -> None:
    """Remove implementation ``name`` of ``op`` (tests, and a platform that withdraws one)."""
    remaining = [known for known in _REGISTRY.get(op, []) if known.name != name]
    if remaining:
        _REGISTRY[op] = remaining
    else:
        _REGISTRY.pop(op, None)


def implementations(op: str) -> list[KernelImpl]:
    """``op``'s implementations, highest priority first."""
    _ensure_builtins()
    return list(_REGISTRY.get(op, []))


def known_ops() -> list[str]:
    """Every op with at least one implementation, sorted."""
    _ensure_builtins()
    return sorted(_REGISTRY)


def _ensure_builtins() -> None:
    """Register the built-in implementations once per process (a platform's own registrations of
    the same name, made earlier, are replaced, as registering a name again always does)."""
    global _builtins_registered
    if not _builtins_registered:
        _builtins_registered = True
        for entry in builtin_kernels():
            _add(entry)
