"""Start-up compiles pieceworks' kernels ahead: launches queue their compile and run nothing.

Inside ``precompiling(device)`` (where the kernels run compiled) ``triton_launch.launch`` hands
each launch to the kernel's ``warmup`` (Triton's compile without a launch; in Triton's
asynchronous compile mode, a pool thread compiles it) and returns None, and a ``KernelLaunch``
neither runs nor binds; outside, or with ``PIECEWORKS_PRECOMPILE_KERNELS=0``, or where the
kernels do not run compiled, a launch runs. Once a queued kernel is compiled, a pool thread
also builds its launcher (Triton's C stub, built at a first launch otherwise). The runner runs
the first forward and one forward of every warm-up shape in the block on a cold start, only the
first on a warm start (the kernels are in the compile cache), then the profiling run outside
it. On the CPU the kernels are stand-ins and the platform is told it runs them compiled.
Run: pytest tests/kernels/test_precompile.py
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import torch

from pieceworks.kernels import precompile, triton_device, triton_launch
from pieceworks.kernels.kernel_launch import KernelLaunch


class StandInKernel:
    """Records warm-ups (compiles) and launches; its first launch returns a stand-in binary."""

    def __init__(self) -> None:
        self.warmups: list[tuple] = []
        self.launches: list[tuple] = []

    def warmup(self, *args, grid, **options):
        self.warmups.append((grid, args, options))

    def __getitem__(self, grid):
        return lambda *args, **options: self.launches.append((grid, args, options))


REAL_DUMMY_FORWARD = None


@pytest.fixture
def compiled_here(monkeypatch):
    """The platform 'runs pieceworks' kernels compiled' on the CPU."""
    monkeypatch.setattr(triton_device, "compiled_kernels_run_on", lambda device: True)
    global REAL_DUMMY_FORWARD
    from pieceworks.worker.graph_capture import GraphCapture

    REAL_DUMMY_FORWARD = REAL_DUMMY_FORWARD or GraphCapture.dummy_forward


def test_a_launch_inside_queues_its_compile_and_runs_nothing(compiled_here):
    kernel, x = StandInKernel(), torch.zeros(4)
    with precompile.precompiling(torch.device("cpu")) as queued:
        assert precompile.is_active()
        assert triton_launch.launch(kernel, (2,), x, 4, BLOCK=8) is None
        KernelLaunch(kernel, (1,), (4,), {"BLOCK": 16})(x)
    assert not precompile.is_active()
    assert queued == [2]
    assert kernel.warmups == [((2,), (x, 4), {"BLOCK": 8}), ((1,), (x, 4), {"BLOCK": 16})]
    assert kernel.launches == []
    triton_launch.launch(kernel, (2,), x, 4, BLOCK=8)
    assert kernel.launches == [((2,), (x, 4), {"BLOCK": 8})]


def test_switched_off_or_not_compiled_here_the_block_does_nothing(monkeypatch, compiled_here):
    kernel = StandInKernel()
    monkeypatch.setenv("PIECEWORKS_PRECOMPILE_KERNELS", "0")
    with precompile.precompiling(torch.device("cpu")) as queued:
        assert not precompile.is_active()
        triton_launch.launch(kernel, (1,), 3)
    assert queued == [0] and kernel.launches and not kernel.warmups
    monkeypatch.delenv("PIECEWORKS_PRECOMPILE_KERNELS")
    monkeypatch.setattr(triton_device, "compiled_kernels_run_on", lambda device: False)
    with precompile.precompiling(torch.device("cpu")):
        assert not precompile.is_active()


def dry_runs(monkeypatch, llm_factory) -> tuple[list, list]:
    """Build an engine, recording the forwards run inside ``precompiling`` and after it."""
    from pieceworks.worker import graph_capture

    inside, after = [], []
    real = REAL_DUMMY_FORWARD

    def spy(self, num_tokens, mode=None, descriptor=None):
        (inside if precompile.is_active() else after).append((num_tokens, descriptor))
        if mode is None:
            return real(self, num_tokens)
        return real(self, num_tokens, mode, descriptor)

    monkeypatch.setattr(graph_capture.GraphCapture, "dummy_forward", spy)
    llm_factory()
    return inside, after


def test_the_runner_compiles_ahead_on_a_cold_start_only(
    monkeypatch, compiled_here, graph_platform, tmp_path
):
    from pieceworks.benchmarks.modes import compilation_for_mode
    from pieceworks.engine.llm import LLM

    monkeypatch.setenv("PIECEWORKS_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("PIECEWORKS_DISABLE_COMPILE_CACHE")  # the suite's default: no cache
    compilation = compilation_for_mode("full_and_piecewise", {"backend": "eager"})

    def build():
        return LLM("llama-tiny", compilation_config=compilation, max_num_seqs=4)

    cold_inside, cold_after = dry_runs(monkeypatch, build)
    warm_inside, warm_after = dry_runs(monkeypatch, build)
    first = cold_inside[0]
    assert first == warm_inside[0] == cold_after[0] == warm_after[0] == (2048, None)
    # Capture sizes 1, 2, 4, 8 (max_num_seqs 4): a uniform-decode shape for the three FULL
    # decode sizes and a mixed shape for all four ran dry, largest first (FULL's first); then
    # the profiling run, the warm-up and the captures ran outside.
    shapes = [(d.num_tokens, d.uniform_decode) for _, d in cold_inside[1:]]
    assert shapes == [
        (8, False),
        (4, True),
        (4, False),
        (2, True),
        (2, False),
        (1, True),
        (1, False),
    ]
    assert len(warm_inside) == 1  # the stored graph loaded: its kernels are cached
    assert len(cold_after) == len(warm_after) == 1 + 2 * 7  # profiling; warm-ups and captures


def test_a_kernel_that_cannot_warm_up_compiles_at_its_first_launch(compiled_here):
    class NoWarmup(StandInKernel):
        def warmup(self, *args, grid, **options):
            raise TypeError("no warm-up for this kind of kernel")

    kernel = NoWarmup()
    with precompile.precompiling(torch.device("cpu")) as queued:
        assert triton_launch.launch(kernel, (1,), 3) is None  # nothing runs, nothing is queued
    assert queued == [0] and kernel.launches == []


class StandInBinary:
    """What a compile gives: a binary whose launcher is built when it is first loaded."""

    def __init__(self, module: object | None = None) -> None:
        self.src, self.metadata, self.module = object(), object(), module


class CompilingKernel(StandInKernel):
    """Its warm-ups return what Triton's do, in turn: a binary, or the handle of one compiling
    (``FutureKernel``: its ``future`` holds the binary)."""

    def __init__(self, results: list) -> None:
        super().__init__()
        self.results = list(results)

    def warmup(self, *args, grid, **options):
        super().warmup(*args, grid=grid, **options)
        return self.results.pop(0)


def test_a_compiled_kernels_launcher_is_built_in_the_pool(monkeypatch, compiled_here):
    built = []

    def launcher_class():
        return lambda src, metadata: built.append((src, threading.current_thread().name))

    monkeypatch.setattr(precompile, "launcher_class", launcher_class)
    fresh, loaded, compiled_later = StandInBinary(), StandInBinary("loaded"), StandInBinary()
    done, failed = Future(), Future()
    done.set_result(compiled_later)
    failed.set_exception(RuntimeError("this compile failed"))
    kernel = CompilingKernel(
        [fresh, fresh, loaded, SimpleNamespace(future=done), SimpleNamespace(future=failed)]
    )
    with precompile.precompiling(torch.device("cpu")) as queued:
        for _ in range(5):
            triton_launch.launch(kernel, (1,), 3)
    assert queued == [5]
    # Once per binary (the twice-queued one too), not for one already loaded or a failed
    # compile, and in the pool's threads.
    assert sorted(id(src) for src, _ in built) == sorted([id(fresh.src), id(compiled_later.src)])
    assert all(thread.startswith("pieceworks-compile") for _, thread in built)
