"""``RunnerStartup``: the model runner's start-up, from its first forward to its last capture.

``ModelRunner`` (``worker/model_runner.py``) inherits it; its constructor sets up what start-up
reads (the model and its static-graph wrappers, the input buffers, the dispatcher, the decode
tails). Start-up is two calls, made by the executor (on every tensor-parallel rank):

1. ``initialize_kv_cache``: the first forward compiles the model (Dynamo traces and the pieces
   compile, or a warm start loads the stored graph and the artifacts). Where pieceworks' kernels
   run compiled, that forward and one forward of every warm-up shape run dry first, so the
   kernels compile, and their launchers build, in a pool of threads (``kernels/precompile.py``).
   Then the profiling run at the largest token count measures the activations' peak, the
   memory the graphs will hold is estimated and held back, and the KV cache takes the rest.
2. ``capture_model``: every distinct shape warms up (uncaptured), then every (mode, descriptor)
   of the dispatcher is captured, largest first, each FULL graph of a decode size followed by
   its decode tails; the captured graphs' footprint is logged beside the estimate.

``release_graphs`` drops them again at shutdown. Each phase's seconds are kept on the runner for
``bench startup`` (``compile_seconds``, ``kernel_compile_seconds``, ``warmup_seconds``, ...).
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from pieceworks.core.config import CUDAGraphMode
from pieceworks.core.counters import compilation_counter
from pieceworks.core.decorators import static_graph_wrappers
from pieceworks.core.forward_context import BatchDescriptor, set_forward_context
from pieceworks.core.static_graph import StaticGraphWrapperBase
from pieceworks.core.trace_once import trace_once_compilers
from pieceworks.kernels import precompile
from pieceworks.kernels.chooser import KernelChooser
from pieceworks.kernels.precompile import precompiling
from pieceworks.logger import init_logger
from pieceworks.scheduler.block_manager import cdiv
from pieceworks.worker.input_buffers import StepShape
from pieceworks.worker.kv_cache import (
    GIB,
    KVCacheSpec,
    allocate_kv_cache,
    attention_layers,
    estimate_graph_memory,
    num_blocks_that_fit,
    num_graphs_to_capture,
)
from pieceworks.worker.mamba_cache import allocate_mamba_cache

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig
    from pieceworks.core.config import CompilationConfig
    from pieceworks.core.cudagraph_dispatcher import CudagraphDispatcher
    from pieceworks.core.static_graph import StaticGraphSet
    from pieceworks.platforms.interface import Platform
    from pieceworks.worker.input_buffers import InputBuffers
    from pieceworks.worker.mamba_cache import MambaCacheSpec

logger = init_logger(__name__)


class RunnerStartup:
    """The start-up half of ``ModelRunner``: sizes the KV cache, warms up and captures.

    Reads what ``ModelRunner.__init__`` sets (annotated below) and sets the phase timings and
    ``num_blocks``; the step's own work (``plan``, ``execute_async``) stays in ``ModelRunner``.
    """

    config: EngineConfig
    compilation: CompilationConfig
    platform: Platform
    device: torch.device
    model: Any
    kernels: KernelChooser  # the engine's kernel choices (``kernels/chooser.py``)
    forward_model: Any
    dispatcher: CudagraphDispatcher
    static_graphs: StaticGraphSet
    buffers: InputBuffers
    mamba_spec: MambaCacheSpec | None
    block_size: int
    max_num_tokens: int
    decode_tails: list[Any]
    decode_tail_descriptors: set[BatchDescriptor]
    num_blocks: int
    compile_seconds: float
    kv_cache_seconds: float
    kernel_compile_seconds: float
    capture_seconds: float
    warmup_seconds: float
    graph_memory_bytes: int
    graph_memory_estimate_bytes: int

    def _own(self, wrapper: Any) -> None:
        """Keep ``wrapper`` in this runner's set (a vendor's class that is not a
        ``StaticGraphWrapperBase`` keeps its own capture bookkeeping)."""
        if isinstance(wrapper, StaticGraphWrapperBase):
            self.static_graphs.add(wrapper)

    @torch.inference_mode()
    def initialize_kv_cache(self) -> int:
        """Compile (first forward, largest size), measure its peak, allocate the KV cache."""
        dtype = self.config.model_config.dtype
        assert isinstance(dtype, torch.dtype)  # resolved in ModelConfig.__post_init__
        spec = KVCacheSpec(attention_layers(self.config), self.block_size, dtype)
        allocate_kv_cache(spec, 1, self.device)  # a placeholder for the profiling forward
        if self.mamba_spec is not None:
            # Full size before profiling: the peak measured below then excludes it from the KV
            # budget. Its size is fixed by max_num_seqs, not by the memory left.
            allocate_mamba_cache(self.mamba_spec, self.device, self.platform.mem_get_info()[0])
            logger.info(
                "Mamba state cache: %d slots x %d layers (%.3f GiB)",
                self.mamba_spec.num_slots,
                len(self.mamba_spec.layers),
                self.mamba_spec.num_bytes / GIB,
            )
        self.platform.synchronize()
        start = time.perf_counter()
        self._precompile_kernels()
        self.platform.synchronize()
        self.platform.reset_peak_memory_stats()
        allocated_before = self.platform.memory_allocated()
        self._dummy_forward(self.max_num_tokens)  # the profiling run (the first call compiles)
        self.platform.synchronize()
        self.compile_seconds = time.perf_counter() - start - self.kernel_compile_seconds
        free, total = self.platform.mem_get_info()
        peak = self.platform.max_memory_allocated()
        activation_bytes_per_token = max(peak - allocated_before, 0) / self.max_num_tokens
        modes = [mode for mode, _ in self.dispatcher.capture_descriptors()]
        self.graph_memory_estimate_bytes = estimate_graph_memory(
            self.config, num_graphs_to_capture(self.config, modes), activation_bytes_per_token
        )
        self.num_blocks = smallest_over_ranks(
            num_blocks_that_fit(
                self.config, spec, free, total, peak, self.graph_memory_estimate_bytes
            )
        )
        start = time.perf_counter()
        allocate_kv_cache(spec, self.num_blocks, self.device)
        self.platform.synchronize()
        self.kv_cache_seconds = time.perf_counter() - start
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB); first forward (compile) %.1f s",
            self.num_blocks,
            self.block_size,
            self.num_blocks * spec.bytes_per_block / GIB,
            self.compile_seconds,
        )
        return self.num_blocks

    def _precompile_kernels(self) -> None:
        """Where pieceworks' kernels can be compiled ahead (``kernels/precompile.py``): the first
        forward (Dynamo traces, the pieces compile or load) as a dry run, then, unless it loaded
        a stored graph (a warm start, whose kernels are in the compile cache already), one dry
        forward of every warm-up shape; their kernels compile in a pool of threads meanwhile.
        The time after the first forward is ``kernel_compile_seconds``. Elsewhere nothing runs
        here and the profiling run is the first forward."""
        with precompiling(self.device) as queued:
            if not precompile.is_active():
                return
            self._dummy_forward(self.max_num_tokens)
            start = time.perf_counter()
            if not any(c.graph_load_seconds for c in trace_once_compilers(self.model)):
                for descriptor in self._warm_up_shapes():
                    self._dummy_forward(descriptor.num_tokens, CUDAGraphMode.NONE, descriptor)
        self.kernel_compile_seconds = time.perf_counter() - start
        logger.info(
            "compiled %d kernel launches ahead in %.2f s", queued[0], self.kernel_compile_seconds
        )

    def _warm_up_shapes(self) -> list[BatchDescriptor]:
        """One descriptor per distinct shape the capture sizes warm up, largest first."""
        descriptors = [descriptor for _, descriptor in self.dispatcher.capture_descriptors()]
        return list({(d.num_tokens, d.uniform_decode): d for d in descriptors}.values())

    def _dummy_forward(
        self,
        num_tokens: int,
        mode: CUDAGraphMode = CUDAGraphMode.NONE,
        descriptor: BatchDescriptor | None = None,
    ) -> None:
        shape = self._capture_shape(descriptor) if descriptor else self._profile_shape(num_tokens)
        uniform_decode = descriptor is not None and descriptor.uniform_decode
        metadata = self.buffers.prepare_dummy(shape, uniform_decode)
        with set_forward_context(
            metadata, self.config, cudagraph_runtime_mode=mode, batch_descriptor=descriptor
        ):
            hidden_states = self.forward_model(*self.buffers.model_inputs(shape))
            if descriptor in self.decode_tail_descriptors and mode != CUDAGraphMode.PIECEWISE:
                # After the FULL graph (or its warm-up): each decode tail of this descriptor,
                # reading the forward's output where the graph leaves it.
                for tail in self.decode_tails:
                    tail(hidden_states)
                if mode == CUDAGraphMode.FULL:
                    compilation_counter.num_decode_tails_captured += len(self.decode_tails)
        self.platform.synchronize()  # the next dummy step reuses the pinned staging buffer

    def _decode_tail_descriptors(self) -> set[BatchDescriptor]:
        """The FULL graphs' descriptors that get decode tails: those of at most
        ``max_num_seqs`` tokens (a tail samples a decode batch that fills its size)."""
        if not self.decode_tails:
            return set()
        max_num_seqs = self.config.scheduler_config.max_num_seqs
        return {
            descriptor
            for mode, descriptor in self.dispatcher.capture_descriptors()
            if mode == CUDAGraphMode.FULL and descriptor.num_tokens <= max_num_seqs
        }

    def _profile_shape(self, num_tokens: int) -> StepShape:
        """The largest step as prefills no longer than max_model_len each."""
        max_model_len = self.config.model_config.max_model_len or num_tokens
        num_seqs = min(cdiv(num_tokens, max_model_len), self.config.scheduler_config.max_num_seqs)
        max_query_len = cdiv(num_tokens, num_seqs)
        return StepShape(num_tokens, num_tokens, num_seqs, num_seqs, max_query_len)

    def _capture_shape(self, descriptor: BatchDescriptor) -> StepShape:
        num_tokens = descriptor.num_tokens
        if descriptor.uniform_decode:
            return StepShape(num_tokens, num_tokens, num_tokens, num_tokens, 1)
        num_seqs = min(num_tokens, self.config.scheduler_config.max_num_seqs)
        return StepShape(num_tokens, num_tokens, num_seqs, num_seqs, num_tokens)

    @torch.inference_mode()
    def capture_model(self) -> None:
        """Warm every batch shape up, then capture every (mode, descriptor), largest first, then
        close capturing. All warm-ups run before the first capture, once per distinct shape, so
        every kernel is compiled and tuned (Triton specialisations, static-size compiles) before
        capturing starts and the captures only record; gc runs once, before them all."""
        descriptors = self.dispatcher.capture_descriptors()
        if not descriptors:
            return
        for wrapper in static_graph_wrappers(self.model):  # built by the first (compiling) forward
            self._own(wrapper)
        self.static_graphs.open_capturing()
        free_before, _ = self.platform.mem_get_info()
        gc.collect()
        gc.freeze()  # objects alive now are never collected during capture: faster gc passes
        logger.debug(
            "the warm-up before capture runs the chosen Triton/Gluon kernels: %s",
            ", ".join(f"{c.op} ({c.impl.name})" for c in self.kernels.warmup_kernels()) or "none",
        )
        try:
            start = time.perf_counter()
            self._warm_up()
            self.warmup_seconds = time.perf_counter() - start
            start = time.perf_counter()
            for mode, descriptor in tqdm(descriptors, desc="capturing graphs", leave=False):
                self._dummy_forward(descriptor.num_tokens, mode, descriptor)
                compilation_counter.num_gpu_runner_capture_triggers += 1
            self.platform.synchronize()
            self.capture_seconds = time.perf_counter() - start
        except (torch.OutOfMemoryError, RuntimeError) as error:
            # The allocator raises OutOfMemoryError; the driver (instantiating a graph) a
            # RuntimeError saying "out of memory". Any other error propagates as it is.
            if not isinstance(error, torch.OutOfMemoryError) and "out of memory" not in str(error):
                raise
            raise RuntimeError(self._capture_oom_message(len(descriptors))) from error
        finally:
            gc.unfreeze()
        self.static_graphs.close_capturing()
        self.graph_memory_bytes = max(free_before - self.platform.mem_get_info()[0], 0)
        logger.info(
            "captured %d graphs in %.2f s after %.2f s of warm-up; graphs hold %.3f GiB "
            "(estimated %.3f GiB before the KV cache was sized)",
            len(descriptors),
            self.capture_seconds,
            self.warmup_seconds,
            self.graph_memory_bytes / GIB,
            self.graph_memory_estimate_bytes / GIB,
        )

    def _warm_up(self) -> None:
        """``cudagraph_num_of_warmups`` uncaptured runs of each distinct shape."""
        for descriptor in self._warm_up_shapes():
            for _ in range(self.compilation.cudagraph_num_of_warmups):
                self._dummy_forward(descriptor.num_tokens, CUDAGraphMode.NONE, descriptor)

    def _capture_oom_message(self, num_descriptors: int) -> str:
        cache_config = self.config.cache_config
        return (
            f"out of device memory while capturing {num_descriptors} graph shapes "
            f"({self.graph_memory_estimate_bytes / GIB:.2f} GiB was estimated for their graphs "
            f"and held back from the KV cache). Lower gpu_memory_utilization (now "
            f"{cache_config.gpu_memory_utilization}) to leave more outside the KV cache, or "
            f"capture fewer or smaller sizes (lower max_num_seqs, now "
            f"{self.config.scheduler_config.max_num_seqs}, or set cudagraph_capture_sizes), or "
            "run without graphs (cudagraph_mode=NONE)."
        )

    def release_graphs(self) -> int:
        """Drop every static graph this runner captured, once the device is done with them (at
        shutdown, before a process group whose collectives they hold is destroyed); how many.
        Graphs captured later, by another engine, go to a new pool."""
        self.platform.synchronize()
        released = self.static_graphs.release()
        if released:
            self.platform.renew_graph_pool()
            gc.collect()
            self.platform.empty_cache()
        return released


def smallest_over_ranks(value: int) -> int:
    """The smallest ``value`` of all tensor-parallel ranks (every rank must hold the same KV)."""
    from pieceworks.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized() or get_tp_group().world_size == 1:
        return value
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
    return int(tensor.item())
