"""``precompiling``: compile pieceworks' Triton kernels before their first launch, in parallel.

A cold start compiles each of pieceworks' own kernels (the GEMV per token count, decode
attention per capture size, prefill attention, the KV store, rotary, argmax) the first time it
is launched, one after another, in the profiling run and in the warm-up before capture (9.7 s of
the 8B shape's 27 s cold start, ``docs/performance.md``, "Startup"). Inside
``precompiling(device)`` every launch made through ``triton_launch.launch`` runs nothing: it
hands the kernel and its arguments to Triton's asynchronous compile mode
(``triton.runtime._async_compile.AsyncCompileMode``), which specializes them as a launch would
and compiles the binary in a pool of threads (Triton's C++ passes and ``ptxas`` release the
GIL); leaving the block waits for every compile. The runner runs the forward of every start-up
shape once inside it (a dry run: no pieceworks kernel runs, so those forwards compute nothing
meaningful and write no cache), and the real profiling run and warm-up then find each binary in
Triton's in-process cache.

A binary is not all a first launch builds: Triton also compiles a small C launcher per kernel
signature (``driver.active.launcher_cls``, a run of the C compiler) when the binary is first
loaded, which left alone happens one launcher after another on the main thread (seconds of a
cold start: ``docs/performance.md``, "Startup"). So once a queued binary is compiled, a pool
thread builds its launcher too; Triton keeps the built module in its cache directory, where the
first launch finds it. The binary itself is loaded onto the device at that launch, on the
launching thread, as before.

Where Triton has no asynchronous compile mode, where the kernels are interpreted
(``TRITON_INTERPRET=1``) or do not run on ``device``, or with ``PIECEWORKS_PRECOMPILE_KERNELS=0``,
the block does nothing and every kernel compiles at its first launch as before. A compile that
fails in the pool is dropped: the real launch compiles it again and raises there.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from pieceworks.logger import init_logger

logger = init_logger(__name__)

MAX_WORKERS = 32
_queued: list[int] | None = None  # while precompiling: [launches queued]
_pool: ThreadPoolExecutor | None = None  # while precompiling: the compile threads
_launchers: set[int] = set()  # ids of the compiles whose launcher is being built


def is_active() -> bool:
    """Whether launches are being queued for compilation instead of run."""
    return _queued is not None


def queue(kernel: Any, grid: Any, args: tuple, options: dict[str, Any]) -> None:
    """Queue the compile of ``kernel[grid](*args, **options)`` (inside ``precompiling``). A
    kernel Triton cannot warm up this way is left to compile at its first launch, which raises
    there if it must."""
    assert _queued is not None, "queue() outside precompiling()"
    try:
        compiled = kernel.warmup(*args, grid=grid, **options)
    except Exception as error:
        name = getattr(kernel, "__name__", type(kernel).__name__)
        logger.info("%s compiles at its first launch: warming it up failed (%s)", name, error)
        return
    _queued[0] += 1
    if _pool is not None and compiled is not None and id(compiled) not in _launchers:
        _launchers.add(id(compiled))
        _pool.submit(build_launcher, compiled)


def build_launcher(compiled: Any) -> None:
    """Build the launcher of ``compiled`` (a Triton ``CompiledKernel``, or the ``FutureKernel``
    of one still compiling, which is waited for) into Triton's cache, unless it is loaded
    already. Nothing is raised: a launcher not built here is built at the first launch."""
    future = getattr(compiled, "future", None)  # a FutureKernel of the asynchronous mode
    try:
        binary = future.result() if future is not None else compiled
        if getattr(binary, "module", None) is not None:
            return  # loaded: its launcher exists
        launcher_class()(binary.src, binary.metadata)
    except Exception as error:  # the compile failed, or this Triton builds launchers otherwise
        logger.debug("no launcher built ahead for %r: %s", compiled, error)


def launcher_class() -> Any:
    """The launcher class of Triton's active driver (it builds the launcher when made)."""
    from triton.runtime.driver import driver

    return driver.active.launcher_cls


@contextlib.contextmanager
def precompiling(device: torch.device) -> Iterator[list[int]]:
    """Queue the compile of every launch in the block, then wait for all of them. Yields a
    one-item list that holds, once the block is left, how many launches were queued (0 when
    the block did nothing, see the module docstring)."""
    global _queued, _pool
    from pieceworks import envs
    from pieceworks.kernels.triton_device import compiled_kernels_run_on

    count = [0]
    async_compile_mode = _async_compile_mode()
    if (
        _queued is not None
        or async_compile_mode is None
        or not envs.PIECEWORKS_PRECOMPILE_KERNELS
        or not compiled_kernels_run_on(device)
    ):
        yield count
        return
    cpus = (
        os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    )
    workers = min(len(cpus), MAX_WORKERS)
    with (
        ThreadPoolExecutor(workers, thread_name_prefix="pieceworks-compile") as pool,
        async_compile_mode(pool, ignore_errors=True),
    ):
        _queued, _pool = count, pool
        try:
            yield count
        finally:
            _queued, _pool = None, None
            _launchers.clear()


def _async_compile_mode() -> Any:
    """Triton's ``AsyncCompileMode`` class, or None where this Triton has none."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        return None
    return AsyncCompileMode
