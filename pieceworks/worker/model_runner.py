"""``ModelRunner``: loads the model, sizes the KV cache, captures graphs, executes steps.

Per step: lay the scheduled requests into the persistent buffers (padded to a capture size),
fill decode tokens still on the device from the previous step's sampled ids, ask the
``CudagraphDispatcher`` which graph serves the batch, run the forward under
``set_forward_context``, then compute logits and sample outside the graph, and start copying the
sampled ids to pinned host memory. A multi-step output (``SchedulerOutput.num_steps`` > 1, a
uniform decode batch) then runs the same graph again ``num_steps - 1`` times, each time after
``InputBuffers.advance_decode`` has fed the sampled ids back as input ids and moved positions,
lengths and slots on by one on the device (the slots staged by ``prepare``); the ids of all its
steps go to the host in one copy.
A FULL decode step whose batch fills its graph's size, all greedy, samples in captured decode
tails instead (``worker/decode_tail.py``): each step is its FULL graph and its tail, which also
advances the buffers to the next step of the run.
``execute_async`` returns at once with a ``SampledTokens`` handle; its ``tolist()`` is the step's
one host sync, which async scheduling defers until the next step is launched.
Start-up (``initialize_kv_cache``, ``capture_model``: compile, size the KV cache, warm up,
capture) is ``RunnerStartup``'s, in ``worker/runner_startup.py``, which this class inherits.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import torch

from pieceworks.config import EngineConfig
from pieceworks.core.config import CompilationLevel, CUDAGraphMode
from pieceworks.core.cudagraph_dispatcher import CudagraphDispatcher
from pieceworks.core.forward_context import BatchDescriptor, set_forward_context
from pieceworks.core.static_graph import CUDAGraphOptions, StaticGraphSet
from pieceworks.kernels.chooser import KernelChooser
from pieceworks.logger import init_logger
from pieceworks.models.attention.metadata import AttentionMetadata
from pieceworks.models.loading.sources import get_model
from pieceworks.platforms import current_platform
from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.block_manager import cdiv
from pieceworks.scheduler.scheduler import SchedulerOutput
from pieceworks.worker.decode_tail import DecodeTail
from pieceworks.worker.input_buffers import InputBuffers, StepShape
from pieceworks.worker.logprobs import TokenLogprobs, prompt_logprobs, sample_logprobs
from pieceworks.worker.mamba_cache import mamba_cache_spec
from pieceworks.worker.runner_startup import RunnerStartup
from pieceworks.worker.sampled_tokens import SampledTokens
from pieceworks.worker.sampler import Sampler, make_generator, row_param_tensor

logger = init_logger(__name__)

# Step plans kept (one per batch shape: token count, requests, longest query, uniform decode)
# before the cache starts over; decode shapes are few, prefill and mixed ones many.
MAX_CACHED_PLANS = 4096


class ModelRunner(RunnerStartup):
    """Loads the model, builds its graph wrappers and decode tails, and executes steps (start-up
    is inherited from ``RunnerStartup``). One per rank."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = current_platform()
        self.device = self.platform.device(config.parallel_config.local_rank or 0)
        # this engine's kernel choices, made once per layer as the model is built
        self.kernels = KernelChooser.for_platform(self.platform, config.compilation_config)
        start = time.perf_counter()
        self.model: Any = get_model(config, self.device, self.kernels).requires_grad_(False)
        self.load_seconds = time.perf_counter() - start
        self.compilation = config.compilation_config
        self.dispatcher = CudagraphDispatcher(config)
        # Every static-graph wrapper this runner built or compiled: its capture phase and graphs.
        self.static_graphs = StaticGraphSet()
        self.forward_model = self._wrap_for_graphs(self.model)
        scheduler_config = config.scheduler_config
        self.max_num_tokens = max(
            scheduler_config.max_num_batched_tokens, self.compilation.max_capture_size
        )
        max_model_len = config.model_config.max_model_len or 0
        self.block_size = config.cache_config.block_size
        self.buffers = InputBuffers(
            self.max_num_tokens,
            scheduler_config.max_num_seqs,
            cdiv(max_model_len, self.block_size),
            self.device,
            self.platform.pin_memory(),
            self.platform.create_event,
            max_num_steps=scheduler_config.num_scheduler_steps,
        )
        # The last launched step's sampled ids (device) and each request's row in them.
        self.last_sampled: torch.Tensor | None = None
        self.last_sampled_rows: dict[str, int] = {}
        self._token_staging = [
            torch.zeros(
                scheduler_config.max_num_seqs * scheduler_config.num_scheduler_steps,
                dtype=torch.int64,
                pin_memory=self.platform.pin_memory(),
            )
            for _ in range(2)
        ]
        self._token_events = [self.platform.create_event() for _ in range(2)]
        self._num_steps = 0
        self._plans: dict[tuple[int, int, int, bool], Any] = {}  # batch shape -> plan()
        # Per multi-step index: the decode tail's static-graph wrapper (none without FULL graphs),
        # and the FULL graphs' descriptors whose steps it samples (``worker/decode_tail.py``).
        self.decode_tails = self._build_decode_tails()
        self.decode_tail_descriptors = self._decode_tail_descriptors()
        self.mamba_spec = mamba_cache_spec(config)
        # State slots the scheduler hands out (0: no Mamba layers, no slots).
        self.num_state_slots = self.mamba_spec.num_slots if self.mamba_spec else 0
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator | None] = {}
        self.num_blocks = 0
        self.compile_seconds = 0.0
        self.kv_cache_seconds = 0.0  # allocating (and zeroing) the KV cache once it is sized
        self.kernel_compile_seconds = 0.0  # pieceworks' kernels compiled ahead, in parallel
        self.capture_seconds = 0.0  # recording only; the warm-ups before it are warmup_seconds
        self.warmup_seconds = 0.0
        self.graph_memory_bytes = 0
        self.graph_memory_estimate_bytes = 0

    # --- set-up ------------------------------------------------------------------------------
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
            tail = DecodeTail(self.model, self.buffers, step, advance=step < max_num_steps - 1)
            wrapper = wrapper_cls(tail, self.config, CUDAGraphMode.FULL)
            self._own(wrapper)
            tails.append(wrapper)
        return tails

    # --- execution ---------------------------------------------------------------------------
    def plan(
        self, output: SchedulerOutput
    ) -> tuple[StepShape, CUDAGraphMode, BatchDescriptor | None]:
        """Pad the step to a capture size and pick its graph mode (worked out once per batch
        shape: the capture sizes and captured graphs never change while serving)."""
        key = (
            output.num_scheduled_tokens,
            output.num_requests,
            output.max_query_len,
            output.is_uniform_decode,
        )
        planned = self._plans.get(key)
        if planned is None:
            if len(self._plans) >= MAX_CACHED_PLANS:
                self._plans.clear()
            planned = self._plans[key] = self._plan(*key)
        return planned

    def _plan(
        self, num_tokens: int, num_seqs: int, max_query_len: int, uniform: bool
    ) -> tuple[StepShape, CUDAGraphMode, BatchDescriptor | None]:
        if num_tokens <= self.compilation.max_capture_size:
            padded = self.compilation.pad_for_cudagraph(num_tokens)
            mode, descriptor = self.dispatcher.dispatch(BatchDescriptor(padded, uniform))
        else:
            padded, mode, descriptor = num_tokens, CUDAGraphMode.NONE, None
        if mode == CUDAGraphMode.FULL:  # the captured layout, holding the real batch
            assert descriptor is not None
            shape = dataclasses.replace(
                self._capture_shape(descriptor), num_tokens=num_tokens, num_seqs=num_seqs
            )
            return shape, mode, descriptor
        if mode == CUDAGraphMode.NONE:
            padded = num_tokens
        return StepShape(num_tokens, padded, num_seqs, num_seqs, max_query_len), mode, descriptor

    def execute(self, output: SchedulerOutput) -> list[int]:
        """Run one scheduled step; return one sampled token per request that produces one."""
        return self.execute_async(output).tolist()  # the step's one host sync

    @torch.inference_mode()
    def execute_async(self, output: SchedulerOutput) -> SampledTokens:
        """Launch one scheduled step; the handle gives its sampled tokens (one per producing
        request, in scheduled order) once the device has them, and the log-probabilities of the
        requests that asked for them."""
        step = self._prepare(output)
        params, generators, rows = self._sampling_inputs(output)
        if self._uses_decode_tail(output, step, params):
            return self._finish_launch(self._run_decode_tails(step, output.num_steps), rows)
        hidden_states = self._run_model(step)
        prompt = self._prompt_logprobs(output, hidden_states)
        if self.buffers.num_logits == 0:
            return SampledTokens(None, None, prompt_logprobs=prompt)
        logits = self.model.compute_logits(self.buffers.logits_rows(hidden_states))  # (S, V)
        token_ids = self.sampler.sample(logits, params, generators)
        token_ids = same_on_every_rank(token_ids)
        logprobs = sample_logprobs(logits, params, token_ids)  # None unless a request asked
        all_token_ids = token_ids
        if output.num_steps > 1:
            all_token_ids = self._decode_steps(
                step, output.num_steps, token_ids, params, generators
            )
        return self._finish_launch(all_token_ids, rows, logprobs, prompt)

    def _finish_launch(
        self,
        all_token_ids: torch.Tensor,
        rows: dict[str, int],
        logprobs: tuple[list[int], TokenLogprobs] | None = None,
        prompt: dict[str, tuple[int, TokenLogprobs]] | None = None,
    ) -> SampledTokens:
        """Keep the last step's ids (the next step's inputs) and start copying every step's ids
        ``(num_steps * S,)`` to the host."""
        self.last_sampled = all_token_ids[-len(rows) :]
        self.last_sampled_rows = rows
        self._num_steps += 1
        index = self._num_steps % 2
        staging = self._token_staging[index][: all_token_ids.shape[0]]
        staging.copy_(all_token_ids, non_blocking=True)
        event = self._token_events[index]
        if event is not None:
            event.record()
        return SampledTokens(staging, event, logprobs=logprobs, prompt_logprobs=prompt)

    def _uses_decode_tail(
        self, output: SchedulerOutput, step: _PreparedStep, params: list[SamplingParams]
    ) -> bool:
        """Whether the step samples in captured decode tails: a FULL graph's step of decodes
        only that fill its size, every row greedy, no log-probabilities asked for."""
        descriptor = step.descriptor
        return (
            step.mode == CUDAGraphMode.FULL
            and descriptor in self.decode_tail_descriptors
            and output.is_uniform_decode
            and descriptor.num_tokens == output.num_requests == len(params)
            and all(param.is_greedy and param.logprobs is None for param in params)
        )

    def _run_decode_tails(self, step: _PreparedStep, num_steps: int) -> torch.Tensor:
        """Each step of the run: its FULL graph, then the tail of its index, which samples into
        ``sampled_steps`` and advances the buffers to the next step. Every step's ids, step 0's
        first: (num_steps * S,), a view of ``sampled_steps``. Every step runs under the same
        forward context (the FULL graph's mode and descriptor, which select the tails' graphs)."""
        inputs = self.buffers.model_inputs(step.shape)
        with set_forward_context(
            step.metadata,
            self.config,
            cudagraph_runtime_mode=step.mode,
            batch_descriptor=step.descriptor,
        ):
            for index in range(num_steps):
                self.decode_tails[index](self.forward_model(*inputs))
        assert step.descriptor is not None
        return self.buffers.sampled_steps[: num_steps * step.descriptor.num_tokens]

    def _decode_steps(
        self,
        step: _PreparedStep,
        num_steps: int,
        token_ids: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """Steps 1 .. ``num_steps`` - 1 of a uniform decode batch whose step 0 sampled
        ``token_ids`` (S,): each runs the same graph on inputs advanced on the device from the
        step before, and samples as step 0 did (each seeded row draws from its generator once per
        step, as in single steps). Every step's ids, step 0's first: (num_steps * S,)."""
        sampled = [token_ids]
        row_params = None  # the rows' sampling parameters on the device, copied once per run
        if not all(param.is_greedy for param in params):
            row_params = row_param_tensor(params, self.device)
        for index in range(1, num_steps):
            self.buffers.advance_decode(sampled[-1], index)
            hidden_states = self._run_model(step)
            logits = self.model.compute_logits(self.buffers.logits_rows(hidden_states))
            token_ids = self.sampler.sample(logits, params, generators, row_params)
            sampled.append(same_on_every_rank(token_ids))
        return torch.cat(sampled)

    @torch.inference_mode()
    def compute_logits(self, output: SchedulerOutput) -> torch.Tensor | None:
        """Forward one step; the logits (S, V) of the requests that produce a token, in the LM
        head's dtype."""
        hidden_states = self.forward(output)
        if self.buffers.num_logits == 0:
            return None
        return self.model.compute_logits(self.buffers.logits_rows(hidden_states))  # (S, V)

    def forward(self, output: SchedulerOutput) -> torch.Tensor:
        """Lay the step into the buffers and run the model; the hidden states of every row."""
        return self._run_model(self._prepare(output))

    def _prepare(self, output: SchedulerOutput) -> _PreparedStep:
        """Plan the step and lay it into the buffers, placeholder tokens filled on the device."""
        shape, mode, descriptor = self.plan(output)
        metadata = self.buffers.prepare(
            output.scheduled_requests,
            shape,
            self.block_size,
            self.last_sampled_rows,
            output.num_steps,
        )
        if self.buffers.num_placeholders:  # decode tokens still on the device
            assert self.last_sampled is not None
            self.buffers.fill_placeholders(self.last_sampled)
        return _PreparedStep(metadata, shape, mode, descriptor)

    def _run_model(self, step: _PreparedStep) -> torch.Tensor:
        """The forward of a prepared step on what the buffers hold now."""
        with set_forward_context(
            step.metadata,
            self.config,
            cudagraph_runtime_mode=step.mode,
            batch_descriptor=step.descriptor,
        ):
            return self.forward_model(*self.buffers.model_inputs(step.shape))

    def _prompt_logprobs(
        self, output: SchedulerOutput, hidden_states: torch.Tensor
    ) -> dict[str, tuple[int, TokenLogprobs]] | None:
        """Prompt log-probabilities of the step's prefill rows whose request asked: request id ->
        (first prompt position scored, rows). Every rank computes the logits of the same rows
        (the LM head gathers across ranks); only a rank holding the prompt (rank 0) scores them."""
        rows: list[int] = []
        targets: list[int] = []
        num_top: list[int] = []
        spans: dict[str, tuple[int, int, int]] = {}  # id -> (first position, first row, rows)
        offset = 0
        for item in output.scheduled_requests:
            start, request = offset, item.request
            offset += item.num_new_tokens
            k = request.sampling_params.prompt_logprobs
            if k is None or item.is_decode:
                continue
            prompt, computed = request.prompt_token_ids, item.num_computed_tokens
            # Row i of the chunk (position computed + i) scores prompt token computed + i + 1;
            # rows past the prompt (its last position, resumed generated tokens) score nothing.
            num_scored = max(min(item.num_new_tokens, len(prompt) - 1 - computed), 0)
            if num_scored:
                spans[request.request_id] = (computed + 1, len(rows), num_scored)
            scored = prompt[computed + 1 : computed + 1 + num_scored]
            targets.extend(scored + [0] * (item.num_new_tokens - num_scored))
            rows.extend(range(start, start + item.num_new_tokens))
            num_top.extend([k] * item.num_new_tokens)
        if not rows:
            return None
        index = torch.tensor(rows, device=hidden_states.device)
        target_ids = torch.tensor(targets, device=hidden_states.device)
        values = prompt_logprobs(
            hidden_states[index], self.model.compute_logits, target_ids, num_top
        )
        return {
            request_id: (first, values.slice(row, row + count))
            for request_id, (first, row, count) in spans.items()
        }

    def _sampling_inputs(
        self, output: SchedulerOutput
    ) -> tuple[list[SamplingParams], list[torch.Generator | None], dict[str, int]]:
        """The producing requests' parameters and generators, and each one's sampled row."""
        params, generators, rows = [], [], {}
        for row, scheduled in enumerate(output.producing_requests):
            request = scheduled.request
            params.append(request.sampling_params)
            generators.append(self._generator(request))
            rows[request.request_id] = row
        return params, generators, rows

    def _generator(self, request) -> torch.Generator | None:
        if request.request_id not in self.generators:
            self.generators[request.request_id] = make_generator(
                request.sampling_params, self.device
            )
        return self.generators[request.request_id]

    def release(self, request_id: str) -> None:
        """Forget a finished request's generator."""
        self.generators.pop(request_id, None)


class _PreparedStep(NamedTuple):
    """A step laid into the buffers: what its forward (or forwards, multi-step) runs with."""

    metadata: AttentionMetadata
    shape: StepShape
    mode: CUDAGraphMode
    descriptor: BatchDescriptor | None


def same_on_every_rank(token_ids: torch.Tensor) -> torch.Tensor:
    """Rank 0's sampled ids on every rank (a device broadcast outside the graphs).

    Greedy and seeded rows would agree anyway (the gathered logits are identical); unseeded
    random rows draw from each rank's default generator, which code outside the engine may have
    advanced differently. Each rank feeds these ids to its next step.
    """
    from pieceworks.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

    if not model_parallel_is_initialized() or get_tp_group().world_size == 1:
        return token_ids
    import torch.distributed as dist

    group = get_tp_group()
    dist.broadcast(token_ids, src=group.ranks[0], group=group.device_group)
    return token_ids
