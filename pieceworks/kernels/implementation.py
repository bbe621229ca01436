"""What a kernel implementation is: ``Supports`` (what it needs), ``KernelImpl`` (one
implementation of an op) and ``Choice`` (the one an op got, and why the others were passed over).

Plain records, shared by the registry of implementations (``registry.py``), the built-in entries
(``builtin.py``) and the engine's chooser (``chooser.py``); nothing here registers or chooses.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from pieceworks.platforms.capability import DeviceCapability


@dataclasses.dataclass(frozen=True)
class Supports:
    """What an implementation needs. ``vendors`` None: any vendor; ``features``: every one of
    them on the device; ``dtypes`` None: any dtype; ``platform``: only on the platform of that
    name (an out-of-tree platform's own kernels); ``max_head_size``: the largest head size it
    takes (None: any); ``packages``: Python packages that must be installed, from pieceworks'
    optional dependency ``extra`` (a third-party kernel library)."""

    vendors: frozenset[str] | None = None
    features: frozenset[str] = frozenset()
    dtypes: frozenset[torch.dtype] | None = None
    platform: str | None = None
    max_head_size: int | None = None
    packages: tuple[str, ...] = ()
    extra: str | None = None

    def why_not(
        self,
        platform_name: str,
        capability: DeviceCapability,
        dtype: torch.dtype | None,
        head_size: int | None = None,
    ) -> str | None:
        """Why this does not hold on that platform and device for ``dtype`` and ``head_size``, or
        None if it does."""
        if self.platform is not None and self.platform != platform_name:
            return f"only for platform {self.platform!r}"
        if self.vendors is not None and capability.vendor not in self.vendors:
            return f"for {'/'.join(sorted(self.vendors))} devices, not {capability.vendor}"
        missing = sorted(self.features - capability.features)
        if missing:
            return f"needs {', '.join(missing)}"
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            return f"does not take {str(dtype).removeprefix('torch.')}"
        if head_size is not None and self.max_head_size is not None:
            if head_size > self.max_head_size:
                return f"takes head sizes up to {self.max_head_size}, not {head_size}"
        absent = [name for name in self.packages if not package_installed(name)]
        if absent:
            install = f"pip install 'pieceworks[{self.extra}]'" if self.extra else "install them"
            return f"needs the package(s) {', '.join(absent)}, not installed ({install})"
        return None


@functools.cache
def package_installed(name: str) -> bool:
    """Whether the top-level package ``name`` is installed (found, not imported: a kernel
    library's import can take seconds, and only a layer that runs it pays for that)."""
    return importlib.util.find_spec(name) is not None


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
