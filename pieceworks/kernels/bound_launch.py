"""``BoundKernel``: a compiled Triton kernel launched without Triton's per-call binding.

``kernel[grid](*args, **options)`` binds every argument on every call: it specializes each one
(dtype, 16-byte alignment of a pointer, integer 1 or multiple of 16), hashes the result, looks
the compiled binary up, then launches. For a kernel of 26 arguments that is tens of microseconds
of host time, paid in every PIECEWISE step by every attention layer between the captured
pieces. Where a caller launches the same kernel again and again with the same grid, scalars and
constexprs and only its tensors changing (``KernelLaunch``), the binary the first launch
compiled is the one every later launch uses as long as each tensor has the dtype it had then
and, where it was 16-byte aligned then, still is. A ``BoundKernel`` keeps that binary, Triton's
launcher for it and the arguments after the tensors, and launches with those; a call whose
tensors break the condition, or any call while Triton's launch hooks are set (a profiler such as
Proton), goes through ``kernel[grid]`` as before.

The launcher is called as ``JITFunction.run`` calls it (grid, stream, function, metadata, the
launch metadata and hooks, then every parameter in order, constexprs included), which holds for
the Triton versions pieceworks supports (3.6 to 3.9, torch 2.11 to 2.14); ``bind`` returns None
(and the caller keeps Triton's path) for a kernel whose parameters it cannot lay out, and
``PIECEWORKS_BOUND_TRITON_LAUNCH=0`` turns binding off.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pieceworks.utils import IdentityMemo

ALIGNMENT = 16  # bytes: Triton's pointer specialization


_hooks_holder: Any = None  # where Triton keeps its launch hooks; found on first use


def launch_hooks_set() -> bool:
    """Whether Triton has a launch enter or exit hook to call (then every launch takes its
    path). Triton 3.6 and later keep each as a ``HookChain`` that is empty until a profiler adds
    to it; before that a hook was None or a function. Asked before every bound launch, so the
    object holding the hooks is looked up once, not imported each time."""
    global _hooks_holder
    if _hooks_holder is None:
        try:
            from triton import knobs
        except ImportError:  # before Triton's knobs: the hooks were CompiledKernel attributes
            from triton.compiler.compiler import CompiledKernel

            _hooks_holder = CompiledKernel
        else:
            _hooks_holder = knobs.runtime
    hooks = _hooks_holder
    return _is_set(hooks.launch_enter_hook) or _is_set(hooks.launch_exit_hook)


def _is_set(hook: Any) -> bool:
    calls = getattr(hook, "calls", None)  # a HookChain: set while it holds a function
    return bool(calls) if calls is not None else hook is not None


class BoundKernel:
    """A compiled kernel, its grid and the arguments after its tensors, bound once."""

    def __init__(
        self,
        compiled: Any,
        grid: tuple[int, ...],
        tail: tuple[Any, ...],
        tensors: Sequence[torch.Tensor],
        get_stream: Callable[[int | None], Any] | None = None,
    ) -> None:
        if get_stream is None:  # Triton's: the raw handle of the device's current stream
            from triton.runtime import driver

            get_stream = driver.active.get_current_stream
        self.get_stream = get_stream
        self.launcher = compiled.run  # Triton's launcher for this binary (loads it if needed)
        self.function = compiled.function
        self.packed_metadata = compiled.packed_metadata
        self.grid = (*grid, 1, 1)[:3]
        self.tail = tail
        self.dtypes = tuple(tensor.dtype for tensor in tensors)
        self.aligned = tuple(
            i for i, tensor in enumerate(tensors) if tensor.data_ptr() % ALIGNMENT == 0
        )
        self.device_index = tensors[0].device.index if tensors else None
        self.accepted = IdentityMemo()  # the tensor objects of the last call accepted

    def accepts(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether the bound binary is the one Triton would pick for ``tensors``.

        A launch between replayed graph pieces gets the same tensor objects every step (graph
        outputs, the runner's buffer views, the KV cache), and checking each one's dtype and
        alignment costs more than the launch: the very objects of the last accepted call, all
        still alive, are accepted at once. A tensor's dtype never changes, and its data pointer
        only through ``set_``, which nothing on a launch path calls."""
        if self.accepted.get(tensors):
            return True
        if len(tensors) != len(self.dtypes):
            return False
        for tensor, dtype in zip(tensors, self.dtypes, strict=True):
            if tensor.dtype != dtype:
                return False
        for index in self.aligned:
            if tensors[index].data_ptr() % ALIGNMENT:
                return False
        self.accepted.put(tensors, True)
        return True

    def __call__(self, tensors: Sequence[torch.Tensor]) -> None:
        grid_x, grid_y, grid_z = self.grid
        self.launcher(
            grid_x,
            grid_y,
            grid_z,
            self.get_stream(self.device_index),
            self.function,
            self.packed_metadata,
            None,  # launch metadata: only read by launch hooks, which are not set
            None,
            None,
            *tensors,
            *self.tail,
        )


def bind(
    kernel: Any,
    compiled: Any,
    grid: tuple[int, ...],
    tensors: Sequence[torch.Tensor],
    scalars: Sequence[Any],
    options: dict[str, Any],
    get_stream: Callable[[int | None], Any] | None = None,
) -> BoundKernel | None:
    """A ``BoundKernel`` for the launch ``kernel[grid](*tensors, *scalars, **options)`` that just
    returned ``compiled``; None when it cannot be bound (no compiled binary, a parameter that is
    neither given nor defaulted, binding turned off)."""
    from pieceworks import envs

    if not envs.PIECEWORKS_BOUND_TRITON_LAUNCH or not hasattr(compiled, "packed_metadata"):
        return None
    names = list(getattr(kernel, "arg_names", ()))
    signature = getattr(kernel, "signature", None)
    num_positional = len(tensors) + len(scalars)
    if signature is None or len(names) < num_positional:
        return None
    tail = list(scalars)
    for name in names[num_positional:]:  # the constexprs, in parameter order
        if name in options:
            tail.append(options[name])
            continue
        default = signature.parameters[name].default
        if default is inspect.Parameter.empty:
            return None
        tail.append(default)
    return BoundKernel(compiled, grid, tuple(tail), tensors, get_stream)
