"""A ``KernelLaunch`` launches its first launch's binary directly, and only where Triton would.

On the CPU (no compiled Triton) a stand-in kernel and binary show how the arguments are laid
out: the launcher gets the grid, the stream, the binary's function and metadata, then every
parameter in order (tensors, scalars, the given constexprs and the defaulted ones); a tensor of
another dtype or one no longer 16-byte aligned where it was refuses the bound binary, and the
tensor objects of the last accepted call are accepted again while all of them live; a kernel
with a parameter neither given nor defaulted is not bound, nor is any with
``PIECEWORKS_BOUND_TRITON_LAUNCH=0``. On a GPU (``gpu`` marker) a real kernel launched a hundred
times through the bound binary gives Triton's results, a misaligned view and a set launch hook
go through ``kernel[grid]``, and the bound call costs less host time than Triton's.
Run: pytest tests/kernels/test_bound_launch.py (the GPU part: -m gpu)
"""

from __future__ import annotations

import inspect
import time
from types import SimpleNamespace

import pytest
import torch

from pieceworks.kernels.bound_launch import BoundKernel, bind


def STREAM(device_index):  # noqa: N802 (a constant that is called)
    return "stream"


def stand_in_kernel():
    def kernel(x_ptr, out_ptr, n, scale, BLOCK, MODE=3):  # noqa: N803 (Triton's constexprs)
        pass

    return SimpleNamespace(
        arg_names=list(inspect.signature(kernel).parameters), signature=inspect.signature(kernel)
    )


def stand_in_binary(calls: list) -> SimpleNamespace:
    return SimpleNamespace(
        run=lambda *args: calls.append(args), function="fn", packed_metadata="meta"
    )


def test_the_launcher_gets_every_parameter_in_order():
    calls: list = []
    x, out = torch.zeros(8), torch.zeros(8)
    bound = bind(
        stand_in_kernel(),
        stand_in_binary(calls),
        (4,),
        [x, out],
        (8, 0.5),
        {"BLOCK": 16, "num_warps": 2},
        STREAM,
    )
    assert isinstance(bound, BoundKernel)
    bound([x, out])
    assert calls == [(4, 1, 1, "stream", "fn", "meta", None, None, None, x, out, 8, 0.5, 16, 3)]


def test_a_tensor_triton_would_specialize_otherwise_is_refused():
    x, out = torch.zeros(8), torch.zeros(8)
    bound = bind(
        stand_in_kernel(), stand_in_binary([]), (1,), [x, out], (8, 0.5), {"BLOCK": 16}, STREAM
    )
    assert bound is not None
    assert bound.accepts([torch.zeros(8), torch.ones(8)])
    assert not bound.accepts([torch.zeros(8, dtype=torch.float16), out])
    assert not bound.accepts([torch.zeros(9)[1:], out])  # 4 bytes past an aligned start
    assert not bound.accepts([x])


def test_the_last_accepted_tensors_are_accepted_again_until_one_goes():
    x, out = torch.zeros(8), torch.zeros(8)
    bound = bind(
        stand_in_kernel(), stand_in_binary([]), (1,), [x, out], (8, 0.5), {"BLOCK": 16}, STREAM
    )
    assert bound is not None
    fresh = torch.zeros(8)
    assert bound.accepts([fresh, out])
    assert bound.accepted.ids == (id(fresh), id(out))
    assert bound.accepts([fresh, out])  # the same objects: no look at dtype or alignment
    del fresh  # its id may now be reused by a tensor Triton would specialize otherwise
    assert bound.accepted.ids is None
    assert not bound.accepts([torch.zeros(9)[1:], out])
    assert not bound.accepts([x, torch.zeros(8, dtype=torch.float16)])
    assert bound.accepted.ids is None  # a refused call is never remembered


def test_launch_hooks_count_as_set_only_while_they_hold_a_function():
    from triton import knobs

    from pieceworks.kernels.bound_launch import launch_hooks_set

    assert not launch_hooks_set()  # Triton's empty hook chains
    knobs.runtime.launch_exit_hook.add(print)
    try:
        assert launch_hooks_set()
    finally:
        knobs.runtime.launch_exit_hook.remove(print)
    assert not launch_hooks_set()


def test_what_is_not_bound(monkeypatch):
    x = torch.zeros(8)
    missing = bind(stand_in_kernel(), stand_in_binary([]), (1,), [x, x], (8, 0.5), {})
    assert missing is None  # BLOCK has no default and was not given
    assert bind(stand_in_kernel(), None, (1,), [x, x], (8, 0.5), {"BLOCK": 16}) is None
    monkeypatch.setenv("PIECEWORKS_BOUND_TRITON_LAUNCH", "0")
    assert (
        bind(stand_in_kernel(), stand_in_binary([]), (1,), [x, x], (8, 0.5), {"BLOCK": 16}) is None
    )


@pytest.mark.gpu
def test_bound_launches_on_the_gpu():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    from pieceworks.kernels.kernel_launch import KernelLaunch
    from pieceworks.platforms import current_platform

    @triton.jit
    def scaled_add(x_ptr, y_ptr, out_ptr, n, scale, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 1.0):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask)
        y = tl.load(y_ptr + offsets, mask=mask)
        tl.store(out_ptr + offsets, x * scale + y + SHIFT, mask=mask)

    device = current_platform().device()
    n = 1000
    launch = KernelLaunch(scaled_add, (triton.cdiv(n, 256),), (n, 2.0), {"BLOCK": 256})
    x, y = torch.randn(n, device=device), torch.randn(n, device=device)
    out = torch.empty(n, device=device)
    launch(x, y, out)
    assert launch.bound[0] is not None
    for _ in range(100):
        x, y, out = (
            torch.randn(n, device=device),
            torch.randn(n, device=device),
            torch.empty(n, device=device),
        )
        launch(x, y, out)
        torch.testing.assert_close(out, x * 2.0 + y + 1.0, rtol=0, atol=1e-6)
    storage = torch.randn(n + 1, device=device)
    misaligned = storage[1:]  # 4 bytes past an aligned start: Triton compiles another binary
    launch(misaligned, y, out)
    torch.testing.assert_close(out, misaligned * 2.0 + y + 1.0, rtol=0, atol=1e-6)

    from triton import knobs

    seen: list = []
    hook = seen.append
    knobs.runtime.launch_enter_hook.add(hook)  # what a profiler (Proton) does
    try:
        launch(x, y, out)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen  # a hook sees every launch: Triton's path

    def host_us(call) -> float:
        """The host's time per launch: launches are queued, not waited for (a sync inside the
        timing would count the device, which other processes may be sharing)."""
        current_platform().synchronize()
        start = time.perf_counter()
        for _ in range(200):  # well under the launch queue's depth
            call()
        seconds = time.perf_counter() - start
        current_platform().synchronize()
        return seconds / 200 * 1e6

    bound_us, triton_us = float("inf"), float("inf")
    for _ in range(5):  # in turn, the fastest of each: a busy host slows both alike
        bound_us = min(bound_us, host_us(lambda: launch(x, y, out)))
        triton_us = min(
            triton_us, host_us(lambda: scaled_add[launch.grid](x, y, out, n, 2.0, BLOCK=256))
        )
    assert bound_us < triton_us, (bound_us, triton_us)
