"""``KVCacheProfiler``: the first start-up call, from the first forward to the allocated KV cache.

The executor starts a runner in two calls, on every tensor-parallel rank: ``initialize_kv_cache``
(this module) and ``capture_model`` (``worker/graph_capture.py``). Here:

1. the first forward compiles the model (Dynamo traces and the pieces compile, or a warm start
   loads the stored graph and the artifacts). Where pieceworks' kernels run compiled, that
   forward and one forward of every warm-up shape run dry first, so the kernels compile, and
   their launchers build, in a pool of threads (``kernels/precompile.py``);
2. the profiling run at the largest token count measures the activations' peak;
3. the memory the graphs will hold is estimated and held back, and the KV cache takes the rest
   (the same number of blocks on every rank).

Each phase's seconds are kept for ``bench startup`` (``compile_seconds``,
``kernel_compile_seconds``, ``kv_cache_seconds``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from pieceworks.core.config import CUDAGraphMode
from pieceworks.core.trace_once import trace_once_compilers
from pieceworks.kernels import precompile
from pieceworks.kernels.precompile import precompiling
from pieceworks.logger import init_logger
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
    from pieceworks.platforms.interface import Platform
    from pieceworks.worker.graph_capture import GraphCapture
    from pieceworks.worker.mamba_cache import MambaCacheSpec

logger = init_logger(__name__)


class KVCacheProfiler:
    """Compiles the model, profiles its largest step and sizes the KV cache to the memory left;
    runs its dummy steps through ``graphs`` (which keeps the graph-memory estimate)."""

    def __init__(
        self,
        config: EngineConfig,
        platform: Platform,
        device: torch.device,
        graphs: GraphCapture,
        mamba_spec: MambaCacheSpec | None,
        max_num_tokens: int,
    ) -> None:
        self.config, self.platform, self.device = config, platform, device
        self.graphs = graphs
        self.mamba_spec = mamba_spec
        self.max_num_tokens = max_num_tokens
        self.num_blocks = 0
        self.compile_seconds = 0.0
        self.kernel_compile_seconds = 0.0  # pieceworks' kernels compiled ahead, in parallel
        self.kv_cache_seconds = 0.0  # allocating (and zeroing) the KV cache once it is sized

    @torch.inference_mode()
    def initialize_kv_cache(self) -> int:
        """Compile (first forward, largest size), measure its peak, allocate the KV cache; the
        number of blocks."""
        dtype = self.config.model_config.dtype
        assert isinstance(dtype, torch.dtype)  # resolved in ModelConfig.__post_init__
        spec = KVCacheSpec(
            attention_layers(self.config), self.config.cache_config.block_size, dtype
        )
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
        self.graphs.dummy_forward(self.max_num_tokens)  # the profiling run (the first compiles)
        self.platform.synchronize()
        self.compile_seconds = time.perf_counter() - start - self.kernel_compile_seconds
        free, total = self.platform.mem_get_info()
        peak = self.platform.max_memory_allocated()
        activation_bytes_per_token = max(peak - allocated_before, 0) / self.max_num_tokens
        modes = [mode for mode, _ in self.graphs.dispatcher.capture_descriptors()]
        graph_memory = estimate_graph_memory(
            self.config, num_graphs_to_capture(self.config, modes), activation_bytes_per_token
        )
        self.graphs.graph_memory_estimate_bytes = graph_memory  # for capture's messages
        self.num_blocks = smallest_over_ranks(
            num_blocks_that_fit(self.config, spec, free, total, peak, graph_memory)
        )
        start = time.perf_counter()
        allocate_kv_cache(spec, self.num_blocks, self.device)
        self.platform.synchronize()
        self.kv_cache_seconds = time.perf_counter() - start
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB); first forward (compile) %.1f s",
            self.num_blocks,
            spec.block_size,
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
        graphs = self.graphs
        with precompiling(self.device) as queued:
            if not precompile.is_active():
                return
            graphs.dummy_forward(self.max_num_tokens)
            start = time.perf_counter()
            if not any(c.graph_load_seconds for c in trace_once_compilers(graphs.model)):
                for descriptor in graphs.warm_up_shapes():
                    graphs.dummy_forward(descriptor.num_tokens, CUDAGraphMode.NONE, descriptor)
        self.kernel_compile_seconds = time.perf_counter() - start
        logger.info(
            "compiled %d kernel launches ahead in %.2f s", queued[0], self.kernel_compile_seconds
        )


def smallest_over_ranks(value: int) -> int:
    """The smallest ``value`` of all tensor-parallel ranks (every rank must hold the same KV)."""
    from pieceworks.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized() or get_tp_group().world_size == 1:
        return value
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
    return int(tensor.item())
