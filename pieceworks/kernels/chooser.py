"""The kernel chooser: which implementation of each op a layer runs, decided once when it is built.

Every op (``linear``, ``fp8_linear``, ``rms_norm``, ``silu_and_mul``, ``rotary``, ``argmax``, ...)
has implementations, each a ``KernelImpl`` that states what it supports (``Supports``: vendors,
device features, dtypes, the platform it belongs to) and, for the kernels pieceworks calls
itself, ``fn = None`` (the layer knows how to launch them). The built-in implementations are
registered by ``builtin.py``; an out-of-tree platform adds its own with ``register_kernel``, and
the chooser then prefers it on that platform (``docs/platforms.md``).

``choose(op, dtype=...)`` takes the platform's ``DeviceCapability`` and returns a ``Choice``: the
implementation of highest priority whose ``Supports`` holds, and for each other implementation
why it was passed over. Layers call it in their constructors, never per call; the last choice
per op is remembered (``chosen_kernels``) for the run report and ``pieceworks platforms
--kernels``. While a model is built (``kernel_selection``), vLLM-style ``custom_ops`` of its
``CompilationConfig`` apply: ``-op`` (or ``none`` without ``+op``) gives that op its torch form.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from pieceworks.core.config import CompilationConfig
from pieceworks.platforms.capability import DeviceCapability


@dataclasses.dataclass(frozen=True)
class Supports:
    """What an implementation needs. ``vendors`` None: any vendor; ``features``: every one of
    them on the device; ``dtypes`` None: any dtype; ``platform``: only on the platform of that
    name (an out-of-tree platform's own kernels)."""

    vendors: frozenset[str] | None = None
    features: frozenset[str] = frozenset()
    dtypes: frozenset[torch.dtype] | None = None
    platform: str | None = None

    def why_not(
        self, platform_name: str, capability: DeviceCapability, dtype: torch.dtype | None
    ) -> str | None:
        """Why this does not hold on that platform and device for ``dtype``, or None if it does."""
        if self.platform is not None and self.platform != platform_name:
            return f"only for platform {self.platform!r}"
        if self.vendors is not None and capability.vendor not in self.vendors:
            return f"for {'/'.join(sorted(self.vendors))} devices, not {capability.vendor}"
        missing = sorted(self.features - capability.features)
        if missing:
            return f"needs {', '.join(missing)}"
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            return f"does not take {str(dtype).removeprefix('torch.')}"
        return None


@dataclasses.dataclass(frozen=True)
class KernelImpl:
    """One implementation of ``op``. ``fn``: the callable a layer runs for it (same signature as
    the op's torch form); None for pieceworks' own kernels, which their layers launch.
    ``native``: this is the op's torch form (the fallback every op has). Higher ``priority``
    wins among the supported."""

    op: str
    name: str
    supports: Supports = Supports()
    fn: Callable[..., Any] | None = None
    priority: int = 0
    native: bool = False
    jitted: bool = False  # a Triton/Gluon kernel: warmed up once before capture


@dataclasses.dataclass(frozen=True)
class Choice:
    """The implementation an op got, and ``(name, reason)`` for every one passed over."""

    op: str
    impl: KernelImpl
    passed_over: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        """``op: name (passed over: other: reason; ...)`` for reports."""
        others = "; ".join(f"{name}: {why}" for name, why in self.passed_over)
        return f"{self.op}: {self.impl.name}" + (f" (passed over: {others})" if others else "")


_REGISTRY: dict[str, list[KernelImpl]] = {}
_CHOSEN: dict[str, Choice] = {}
_BUILDING: list[CompilationConfig] = []  # of the models being built, innermost last


def register_kernel(
    op: str,
    impl: Callable[..., Any] | None,
    *,
    name: str,
    supports: Supports = Supports(),
    platform: str | None = None,
    priority: int | None = None,
    native: bool = False,
    jitted: bool = False,
) -> KernelImpl:
    """Register ``impl`` as implementation ``name`` of ``op``; returns the entry.

    ``platform``: shorthand for ``supports.platform`` (an out-of-tree platform registers its
    kernels for itself). An implementation registered for a platform outranks the built-in ones
    there unless ``priority`` says otherwise. Registering a name again replaces the entry.
    """
    if platform is not None:
        supports = dataclasses.replace(supports, platform=platform)
    if priority is None:
        priority = 100 if supports.platform is not None else 0
    entry = KernelImpl(op, name, supports, impl, priority, native, jitted)
    implementations = [known for known in _REGISTRY.get(op, []) if known.name != name]
    _REGISTRY[op] = sorted([*implementations, entry], key=lambda known: -known.priority)
    _CHOSEN.pop(op, None)
    return entry


def unregister_kernel(op: str, name: str) -> None:
    """Remove implementation ``name`` of ``op`` (tests, and a platform that withdraws one)."""
    remaining = [known for known in _REGISTRY.get(op, []) if known.name != name]
    if remaining:
        _REGISTRY[op] = remaining
    else:
        _REGISTRY.pop(op, None)
    _CHOSEN.pop(op, None)


def implementations(op: str) -> list[KernelImpl]:
    """``op``'s implementations, highest priority first."""
    _ensure_builtins()
    return list(_REGISTRY.get(op, []))


def known_ops() -> list[str]:
    _ensure_builtins()
    return sorted(_REGISTRY)


def choose(
    op: str,
    *,
    dtype: torch.dtype | None = None,
    capability: DeviceCapability | None = None,
    platform_name: str | None = None,
    prefer_native: bool | None = None,
) -> Choice:
    """The implementation ``op`` runs on the current platform for ``dtype`` (remembered for the
    report), or on the ``capability`` and ``platform_name`` given (not remembered).
    ``prefer_native``: the op's torch form, the others passed over as switched off; None: as
    ``custom_ops`` of the model being built says. A ValueError if nothing is supported (every
    op registers a native form, so only a misregistered op gets it)."""
    hypothetical = capability is not None or platform_name is not None  # not remembered
    if capability is None or platform_name is None:
        from pieceworks.platforms import current_platform

        platform = current_platform()
        capability = capability or platform.device_capability()
        platform_name = platform_name or platform.name
    if prefer_native is None:
        prefer_native = bool(_BUILDING) and not _BUILDING[-1].custom_op_enabled(op, True)
    chosen: KernelImpl | None = None
    passed_over: list[tuple[str, str]] = []
    for impl in implementations(op):
        why = impl.supports.why_not(platform_name, capability, dtype)
        if why is None and prefer_native and not impl.native:
            why = "switched off (custom_ops)"
        if why is None and chosen is None:
            chosen = impl
        else:
            passed_over.append((impl.name, why or f"{chosen.name if chosen else '?'} ranks higher"))
    if chosen is None:
        reasons = "; ".join(f"{name}: {why}" for name, why in passed_over) or (
            f"none registered; known ops: {', '.join(known_ops())}"
        )
        raise ValueError(
            f"no implementation of kernel op {op!r} runs here ({reasons}); register one for "
            f"platform {platform_name!r} with pieceworks.kernels.register_kernel"
        )
    choice = Choice(op, chosen, tuple(passed_over))
    if not hypothetical:
        _CHOSEN[op] = choice
    return choice


def uses_op_form(op: str) -> bool:
    """Whether a layer calls pieceworks' op for ``op`` (what its kernel runs behind, and what
    the fusion passes match) rather than the torch form: where the chooser gives ``op`` one of
    pieceworks' kernels, unless ``PIECEWORKS_SMALL_M_GEMV`` says otherwise (``0``: the torch
    forms; ``1``: the ops, which fall back to torch inside where their kernel does not run). A
    platform's own implementation (``fn``) is neither: the layer calls it."""
    from pieceworks import envs

    forced = envs.PIECEWORKS_SMALL_M_GEMV
    impl = choose(op, prefer_native=True if forced is False else None).impl
    if impl.fn is not None:
        return False
    return not impl.native if forced is None else forced


def chosen_kernels() -> dict[str, Choice]:
    """The last choice made per op in this process (what the model that was built runs)."""
    return dict(_CHOSEN)


def describe_kernel_choices() -> str:
    """One line per op: what it runs on the current platform and why the others were passed
    over, then the platform's attention and Mamba backends (``Platform.attention_backend``)."""
    from pieceworks.platforms import current_platform

    platform = current_platform()
    remembered = chosen_kernels()
    lines = [f"kernels on {platform.name} ({platform.device_capability().describe()}):"]
    for op in known_ops():
        lines.append("  " + (remembered.get(op) or choose(op)).describe())
    lines.append(f"  attention: {platform.attention_backend_qualname.rsplit('.', 1)[-1]}")
    lines.append(f"  mamba: {platform.mamba_backend_qualname.rsplit('.', 1)[-1]}")
    return "\n".join(lines)


def warmup_kernels() -> list[Choice]:
    """The chosen implementations that are jitted kernels: each must run once before capture,
    so that no compile happens inside a graph."""
    return [choice for choice in _CHOSEN.values() if choice.impl.jitted]


@contextlib.contextmanager
def kernel_selection(compilation: CompilationConfig) -> Iterator[None]:
    """While a model is built: choices follow its ``CompilationConfig.custom_ops``; an entry that
    names no known op is a ValueError listing them (a typo would otherwise change nothing)."""
    named = {entry[1:] for entry in compilation.custom_ops if entry[:1] in "+-"}
    unknown = sorted(named - set(known_ops()))
    if unknown:
        raise ValueError(
            f"custom_ops names unknown op(s) {unknown}; known ops: {', '.join(known_ops())} "
            "(entries: 'all', 'none', '+op', '-op')"
        )
    _BUILDING.append(compilation)
    try:
        yield
    finally:
        _BUILDING.pop()


def _ensure_builtins() -> None:
    from pieceworks.kernels import builtin

    builtin.register_builtin_kernels()
