"""The kernel chooser: which implementation of each op an engine's layers run, decided once per
layer when its model is built.

Every op (``linear``, ``fp8_linear``, ``rms_norm``, ``silu_and_mul``, ``rotary``, ``argmax``, ...)
has implementations in the registry (``registry.py``), each a ``KernelImpl`` that states what it
supports. A ``KernelChooser`` belongs to one engine: the model runner builds it from the engine's
config and its platform (``KernelChooser.for_platform``) and hands it to the model loader, which
gives it to every layer (``choose_kernels(kernels)``). ``choose(op, dtype=...)`` returns a
``Choice``: the implementation of highest priority whose ``Supports`` holds on the chooser's
platform and device, and for each other implementation why it was passed over. vLLM-style
``custom_ops`` of its ``CompilationConfig`` apply: ``-op`` (or ``none`` without ``+op``) gives
that op its torch form. The chooser remembers the last choice per op (``chosen_kernels``): what
the engine's model runs, for the run report, the warm-up before capture and ``pieceworks
platforms --kernels``. Two engines in one process each have their own choices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pieceworks import envs
from pieceworks.core.config import CompilationConfig
from pieceworks.kernels.implementation import Choice, KernelImpl
from pieceworks.kernels.registry import implementations, known_ops
from pieceworks.platforms.capability import DeviceCapability

if TYPE_CHECKING:
    from pieceworks.platforms.interface import Platform


class KernelChooser:
    """One engine's kernel choices on one platform and device, under one ``custom_ops`` list.

    ``platform``: the platform object where there is one (its attention and Mamba backends enter
    ``describe``); a chooser for a hypothetical device (tests, tools) names only the platform and
    its capability. An entry of ``custom_ops`` that names no known op is a ValueError listing
    them (a typo would otherwise change nothing).
    """

    def __init__(
        self,
        platform_name: str,
        capability: DeviceCapability,
        compilation: CompilationConfig | None = None,
        *,
        platform: Platform | None = None,
    ) -> None:
        self.platform_name = platform_name
        self.capability = capability
        self.compilation = compilation or CompilationConfig()
        self.platform = platform
        self._chosen: dict[str, Choice] = {}
        _check_custom_ops(self.compilation)

    @classmethod
    def for_platform(
        cls, platform: Platform, compilation: CompilationConfig | None = None
    ) -> KernelChooser:
        """The chooser of an engine on ``platform`` with its ``compilation`` config."""
        return cls(platform.name, platform.device_capability(), compilation, platform=platform)

    @classmethod
    def for_current_platform(cls, compilation: CompilationConfig | None = None) -> KernelChooser:
        """``for_platform(current_platform(), compilation)``."""
        from pieceworks.platforms import current_platform

        return cls.for_platform(current_platform(), compilation)

    def choose(
        self,
        op: str,
        *,
        dtype: torch.dtype | None = None,
        head_size: int | None = None,
        prefer_native: bool | None = None,
    ) -> Choice:
        """The implementation ``op`` runs for ``dtype`` and ``head_size`` (an attention-like
        op's largest head dimension; None: not a question), remembered for the report.
        ``prefer_native``: the op's torch form, the others passed over as switched off; None: as
        ``custom_ops`` says. A ValueError if nothing is supported (every op registers a native
        form, so only a misregistered op gets it)."""
        if prefer_native is None:
            prefer_native = not self.compilation.custom_op_enabled(op, True)
        chosen: KernelImpl | None = None
        passed_over: list[tuple[str, str]] = []
        for impl in implementations(op):
            why = impl.supports.why_not(self.platform_name, self.capability, dtype, head_size)
            if why is None and prefer_native and not impl.native:
                why = "switched off (custom_ops)"
            if why is None and chosen is None:
                chosen = impl
            else:
                passed_over.append(
                    (impl.name, why or f"{chosen.name if chosen else '?'} ranks higher")
                )
        if chosen is None:
            reasons = "; ".join(f"{name}: {why}" for name, why in passed_over) or (
                f"none registered; known ops: {', '.join(known_ops())}"
            )
            raise ValueError(
                f"no implementation of kernel op {op!r} runs here ({reasons}); register one for "
                f"platform {self.platform_name!r} with pieceworks.kernels.register_kernel"
            )
        choice = Choice(op, chosen, tuple(passed_over))
        self._chosen[op] = choice
        return choice

    def uses_op_form(self, op: str) -> bool:
        """Whether a layer calls pieceworks' op for ``op`` (what its kernel runs behind, and what
        the fusion passes match) rather than the torch form: where ``op`` gets one of pieceworks'
        kernels, unless ``PIECEWORKS_SMALL_M_GEMV`` says otherwise (``0``: the torch forms;
        ``1``: the ops, which fall back to torch inside where their kernel does not run). A
        platform's own implementation (``fn``) is neither: the layer calls it."""
        forced = envs.PIECEWORKS_SMALL_M_GEMV
        impl = self.choose(op, prefer_native=True if forced is False else None).impl
        if impl.fn is not None:
            return False
        return not impl.native if forced is None else forced

    def small_m_gemv_enabled(self, op: str = "linear", dtype: torch.dtype | None = None) -> bool:
        """Whether decode-sized GEMMs of ``op`` (``linear``, ``fp8_linear``) go to pieceworks'
        GEMV ops: where ``op`` gets a GEMV here, unless ``PIECEWORKS_SMALL_M_GEMV`` says
        otherwise (``0`` makes the choice the torch form, ``1`` forces the ops, which fall back
        inside where the kernel does not run)."""
        forced = envs.PIECEWORKS_SMALL_M_GEMV
        choice = self.choose(op, dtype=dtype, prefer_native=True if forced is False else None)
        return choice.impl.jitted if forced is None else forced

    def chosen_kernels(self) -> dict[str, Choice]:
        """The last choice made per op (what the model built with this chooser runs)."""
        return dict(self._chosen)

    def warmup_kernels(self) -> list[Choice]:
        """The chosen implementations that are jitted kernels: each must run once before
        capture, so that no compile happens inside a graph."""
        return [choice for choice in self._chosen.values() if choice.impl.jitted]

    def describe(self) -> str:
        """One line per known op: what it runs (the choice made, else the one this chooser would
        make) and why the others were passed over; then the platform's attention and Mamba
        backends (``Platform.attention_backend``) where the chooser has a platform."""
        lines = [f"kernels on {self.platform_name} ({self.capability.describe()}):"]
        for op in known_ops():
            lines.append("  " + (self._chosen.get(op) or self.choose(op)).describe())
        if self.platform is not None:
            attention = self.platform.attention_backend_qualname.rsplit(".", 1)[-1]
            lines.append(f"  attention: {attention}")
            lines.append(f"  mamba: {self.platform.mamba_backend_qualname.rsplit('.', 1)[-1]}")
        return "\n".join(lines)


def describe_kernel_choices(kernels: KernelChooser | None = None) -> str:
    """``kernels.describe()``; without an engine's chooser, what a default engine on the current
    platform would choose (``pieceworks platforms --kernels``)."""
    return (kernels or KernelChooser.for_current_platform()).describe()


def _check_custom_ops(compilation: CompilationConfig) -> None:
    named = {entry[1:] for entry in compilation.custom_ops if entry[:1] in "+-"}
    unknown = sorted(named - set(known_ops()))
    if unknown:
        raise ValueError(
            f"custom_ops names unknown op(s) {unknown}; known ops: {', '.join(known_ops())} "
            "(entries: 'all', 'none', '+op', '-op')"
        )
