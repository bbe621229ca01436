"""``GraphCapture``: a model runner's static graphs, from their wrappers to their release.

The runner builds one with its model, config, platform, dispatcher and step inputs. It wraps the
model for the static-graph mode (a FULL wrapper around the model; at level 0 with PIECEWISE graphs
a breakable wrapper inside it) and builds the decode tails (``worker/decode_tail.py``), keeping
every wrapper in one ``StaticGraphSet``. The steps then call ``forward_model``; start-up calls:

- ``dummy_forward``: a dummy step of a given size and mode, on the step inputs (the profiling
  run, warm-ups and captures all run one; ``worker/kv_cache_profiler.py`` runs the first);
- ``capture_model``: every distinct shape warms up (uncaptured), then every (mode, descriptor)
  of the dispatcher is captured, largest first, each FULL graph of a decode size followed by its
  decode tails; the captured graphs' footprint is logged beside the estimate;
- ``release_graphs``: drops them again at shutdown.

The warm-up and capture seconds and the graphs' memory are kept here for ``bench startup``.
"""

from __future__ import annotations

import gc
import time
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from pieceworks.core.config import CompilationLevel, CUDAGraphMode
from pieceworks.core.counters import compilation_counter
from pieceworks.core.decorators import static_graph_wrappers
from pieceworks.core.forward_context import BatchDescriptor, set_forward_context
from pieceworks.core.static_graph import CUDAGraphOptions, StaticGraphSet, StaticGraphWrapperBase
from pieceworks.kernels.chooser import KernelChooser
from pieceworks.logger import init_logger
from pieceworks.scheduler.block_manager import cdiv
from pieceworks.worker.decode_tail import DecodeTail
from pieceworks.worker.input_buffers import StepShape
from pieceworks.worker.kv_cache import GIB

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig
    from pieceworks.core.cudagraph_dispatcher import CudagraphDispatcher
    from pieceworks.platforms.interface import Platform
    from pieceworks.worker.step_inputs import StepInputs

logger = init_logger(__name__)


class GraphCapture:
    """The static-graph state of one runner: the model as the steps call it (``forward_model``),
    the decode tails and the descriptors they serve, and every wrapper built or compiled for it.
    """

    def __init__(
        self,
        model: Any,
        config: EngineConfig,
        platform: Platform,
        dispatcher: CudagraphDispatcher,
        inputs: StepInputs,
        kernels: KernelChooser,
    ) -> None:
        self.model, self.config, self.platform = model, config, platform
        self.kernels = kernels  # the engine's kernel choices: the warm-up runs the chosen ones
        self.compilation = config.compilation_config
        self.dispatcher = dispatcher
        self.inputs = inputs
        self.static_graphs = StaticGraphSet()  # every static-graph wrapper of this runner
        self.forward_model = self._wrap_for_graphs(model)
        # Per multi-step index: the decode tail's static-graph wrapper (none without FULL graphs),
        # and the FULL graphs' descriptors whose steps it samples.
        self.decode_tails = self._build_decode_tails()
        self.decode_tail_descriptors = self._decode_tail_descriptors()
        # The masked tail of a step with structured-output requests (None without decode tails)
        # and the static device bitmask it reads, one row per sequence, all tokens allowed
        # until the runner stages a step's rows into it.
        self.grammar_bitmask: torch.Tensor | None = None
        self.masked_decode_tail = self._build_masked_decode_tail()
        self.warmup_seconds = 0.0
        self.capture_seconds = 0.0  # recording only; the warm-ups before it are warmup_seconds
        self.graph_memory_bytes = 0
        self.graph_memory_estimate_bytes = 0

    # --- set-up ------------------------------------------------------------------------------
    def _own(self, wrapper: Any) -> None:
        """Keep ``wrapper`` in this runner's set (a vendor's class that is not a
        ``StaticGraphWrapperBase`` keeps its own capture bookkeeping)."""
        if isinstance(wrapper, StaticGraphWrapperBase):
            self.static_graphs.add(wrapper)

    def _wrap_for_graphs(self, model: Any) -> Any:
        """The model as the steps call it: in a FULL wrapper when the mode has FULL graphs; at
        level 0 with PIECEWISE graphs, first in a breakable wrapper (the eager forward captured
        as segments ended at each splitting op; level 3 wraps its pieces in the backend)."""
        mode = self.compilation.cudagraph_mode
        assert mode is not None  # resolved in CompilationConfig.__post_init__
        forward_model = model
        if mode == CUDAGraphMode.NONE:
            return forward_model
        wrapper_cls = self.platform.static_graph_wrapper_cls()
        eager = self.compilation.level == CompilationLevel.NO_COMPILATION
        if eager and mode.has_piecewise_cudagraphs():
            options = CUDAGraphOptions(breakable=True)
            forward_model = wrapper_cls(
                model, self.config, CUDAGraphMode.PIECEWISE, options=options
            )
            self._own(forward_model)
            logger.info("level 0: %s graphs captured breakable (no compile)", mode.name)
        if mode.has_full_cudagraphs():
            forward_model = wrapper_cls(forward_model, self.config, CUDAGraphMode.FULL)
            self._own(forward_model)
        return forward_model

    def _build_decode_tails(self) -> list[Any]:
        """One FULL-mode wrapper per step index of a decode run, where decode steps run FULL
        graphs on one tensor-parallel rank; empty otherwise."""
        mode = self.compilation.cudagraph_mode
        assert mode is not None
        if not mode.has_full_cudagraphs() or self.config.parallel_config.tensor_parallel_size > 1:
            return []
        wrapper_cls = self.platform.static_graph_wrapper_cls()
        max_num_steps = self.config.scheduler_config.num_scheduler_steps
        tails = []
        for step in range(max_num_steps):
            advance = step < max_num_steps - 1
            tail = DecodeTail(self.model, self.inputs.buffers, step, advance=advance)
            wrapper = wrapper_cls(tail, self.config, CUDAGraphMode.FULL)
            self._own(wrapper)
            tails.append(wrapper)
        return tails

    def _build_masked_decode_tail(self) -> Any:
        """Step 0's tail with the grammar bitmask applied before the argmax, where decode tails
        exist; it advances as step 0's tail does."""
        if not self.decode_tails:
            return None
        vocab_size = self.config.model_config.hf_config["vocab_size"]
        num_words = -(-vocab_size // 32)
        self.grammar_bitmask = torch.full(
            (self.config.scheduler_config.max_num_seqs, num_words),
            -1,  # every bit set: every token allowed
            dtype=torch.int32,
            device=self.inputs.buffers.sampled_steps.device,
        )
        advance = self.config.scheduler_config.num_scheduler_steps > 1
        tail = DecodeTail(
            self.model, self.inputs.buffers, 0, advance=advance, bitmask=self.grammar_bitmask
        )
        wrapper = self.platform.static_graph_wrapper_cls()(tail, self.config, CUDAGraphMode.FULL)
        self._own(wrapper)
        return wrapper

    def _decode_tail_descriptors(self) -> set[BatchDescriptor]:
        """The FULL uniform decode graphs' descriptors, which get decode tails (a tail samples
        a decode batch that fills its size)."""
        if not self.decode_tails:
            return set()
        return {
            descriptor
            for mode, descriptor in self.dispatcher.capture_descriptors()
            if mode == CUDAGraphMode.FULL
            and descriptor.uniform_decode  # at most max_num_seqs tokens (the dispatcher's keys)
            and descriptor.uniform_query_len == 1  # a verify batch samples by launches
        }

    # --- dummy steps -------------------------------------------------------------------------
    def profile_shape(self, num_tokens: int) -> StepShape:
        """The largest step as prefills no longer than max_model_len each."""
        max_model_len = self.config.model_config.max_model_len or num_tokens
        num_seqs = min(cdiv(num_tokens, max_model_len), self.config.scheduler_config.max_num_seqs)
        max_query_len = cdiv(num_tokens, num_seqs)
        return StepShape(num_tokens, num_tokens, num_seqs, num_seqs, max_query_len)

    def capture_shape(self, descriptor: BatchDescriptor) -> StepShape:
        """The layout a graph of ``descriptor`` is captured with (and a FULL step replays)."""
        num_tokens, query_len = descriptor.num_tokens, descriptor.uniform_query_len
        if descriptor.uniform_decode:  # query_len tokens per sequence (1 + k: a verify batch)
            num_seqs = num_tokens // query_len
            return StepShape(num_tokens, num_tokens, num_seqs, num_seqs, query_len)
        num_seqs = min(num_tokens, self.config.scheduler_config.max_num_seqs)
        return StepShape(num_tokens, num_tokens, num_seqs, num_seqs, num_tokens)

    def warm_up_shapes(self) -> list[BatchDescriptor]:
        """One descriptor per distinct shape the capture sizes warm up, largest first."""
        descriptors = [descriptor for _, descriptor in self.dispatcher.capture_descriptors()]
        shapes = {(d.num_tokens, d.uniform_decode, d.uniform_query_len): d for d in descriptors}
        return list(shapes.values())

    def dummy_forward(
        self,
        num_tokens: int,
        mode: CUDAGraphMode = CUDAGraphMode.NONE,
        descriptor: BatchDescriptor | None = None,
    ) -> None:
        """One dummy step: the layout of ``descriptor`` (a warm-up or a capture in ``mode``), or
        the profiling layout of ``num_tokens`` tokens; then its decode tails, where it has any."""
        shape = self.capture_shape(descriptor) if descriptor else self.profile_shape(num_tokens)
        # One token per sequence: marked decodes (a verify batch's sequences are not).
        uniform_decode = (
            descriptor is not None
            and descriptor.uniform_decode
            and descriptor.uniform_query_len == 1
        )
        metadata = self.inputs.prepare_dummy(shape, uniform_decode)
        with set_forward_context(
            metadata, self.config, cudagraph_runtime_mode=mode, batch_descriptor=descriptor
        ):
            hidden_states = self.forward_model(*self.inputs.model_inputs(shape))
            if descriptor in self.decode_tail_descriptors and mode != CUDAGraphMode.PIECEWISE:
                # After the FULL graph (or its warm-up): each decode tail of this descriptor,
                # reading the forward's output where the graph leaves it.
                tails = [*self.decode_tails, self.masked_decode_tail]
                for tail in tails:
                    tail(hidden_states)
                if mode == CUDAGraphMode.FULL:
                    compilation_counter.num_decode_tails_captured += len(tails)
        self.platform.synchronize()  # the next dummy step reuses the pinned staging buffer

    # --- capture -----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_model(self) -> None:
        """Warm every batch shape up, then capture every (mode, descriptor), largest first, then
        close capturing. All warm-ups run before the first capture, once per distinct shape, so
        every kernel is compiled and tuned (Triton specialisations, static-size compiles) before
        capturing starts and the captures only record; gc runs once, before them all."""
        descriptors = self.dispatcher.capture_descriptors()
        if not descriptors:
            return
        compilation_counter.num_gpu_runner_capture_triggers += 1  # one per capture run, as vLLM
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
                self.dummy_forward(descriptor.num_tokens, mode, descriptor)
            self.platform.synchronize()
            self.capture_seconds = time.perf_counter() - start
        except (torch.OutOfMemoryError, RuntimeError) as error:
            # The allocator raises OutOfMemoryError; the driver (instantiating a graph) a
            # RuntimeError saying "out of memory". Any other error propagates as it is.
            if not isinstance(error, torch.OutOfMemoryError) and "out of memory" not in str(error):
                raise
            raise RuntimeError(self.capture_oom_message(len(descriptors))) from error
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
        for descriptor in self.warm_up_shapes():
            for _ in range(self.compilation.cudagraph_num_of_warmups):
                self.dummy_forward(descriptor.num_tokens, CUDAGraphMode.NONE, descriptor)

    def capture_oom_message(self, num_descriptors: int) -> str:
        """What to change when capturing ``num_descriptors`` shapes ran out of device memory."""
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
