"""``ModelRunner``: loads the model, owns its step inputs and graphs, executes steps.

Per step: ``plan`` pads the batch to a capture size and asks the ``CudagraphDispatcher`` which
graph serves it; ``StepInputs.prepare`` lays the scheduled requests into the persistent buffers
and fills the decode tokens still on the device from the previous step's sampled ids; the forward
runs under ``set_forward_context``; logits and sampling run outside the graph, and the sampled
ids start copying to pinned host memory. A multi-step output (``SchedulerOutput.num_steps`` > 1,
a uniform decode batch) then runs the same graph again ``num_steps - 1`` times, each time after
``StepInputs.advance_decode`` has fed the sampled ids back as input ids and moved positions,
lengths and slots on by one on the device (``worker/multi_step.py``); the ids of all its steps
go to the host in one copy.
A step that verifies speculative proposals computes logits for each proposal's row too and keeps
the tokens ``RejectionSampler`` accepts (``worker/spec_decode/``); a batch of decodes that all
verify ``k`` proposals replays a FULL graph captured for ``1 + k`` query tokens per sequence.
A FULL decode step whose batch fills its graph's size, all greedy, samples in captured decode
tails instead (``worker/decode_tail.py``): each step is its FULL graph and its tail, which also
advances the buffers to the next step of the run; a step with structured-output requests runs
the masked tail, which applies the step's grammar bitmask from a static device buffer.
``execute_async`` returns at once with a ``SampledTokens`` handle; its ``tolist()`` is the step's
one host sync, which async scheduling defers until the next step is launched.
Start-up is two calls the runner hands on: ``initialize_kv_cache`` (compile, profile, size the KV
cache: ``KVCacheProfiler``, ``worker/kv_cache_profiler.py``) and ``capture_model`` (warm up and
capture: ``GraphCapture``, ``worker/graph_capture.py``, which also holds the graphs).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import torch

from pieceworks.config import EngineConfig
from pieceworks.core.config import CUDAGraphMode
from pieceworks.core.cudagraph_dispatcher import CudagraphDispatcher
from pieceworks.core.forward_context import BatchDescriptor, set_forward_context
from pieceworks.distributed.communication_op import same_on_every_rank
from pieceworks.kernels.chooser import KernelChooser
from pieceworks.models.attention.metadata import AttentionMetadata
from pieceworks.models.loading.sources import get_model
from pieceworks.platforms import current_platform
from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.block_manager import cdiv
from pieceworks.scheduler.output import SchedulerOutput
from pieceworks.worker.graph_capture import GraphCapture
from pieceworks.worker.input_buffers import InputBuffers, StepShape
from pieceworks.worker.kv_cache import freeable_sliding_window
from pieceworks.worker.kv_cache_profiler import KVCacheProfiler
from pieceworks.worker.logit_bias import has_logit_bias
from pieceworks.worker.logprobs import TokenLogprobs, sample_logprobs, step_prompt_logprobs
from pieceworks.worker.mamba_cache import mamba_cache_spec
from pieceworks.worker.sampled_tokens import SampledTokens
from pieceworks.worker.sampler import Sampler, make_generator, row_param_tensor
from pieceworks.worker.spec_decode.rejection_sampler import RejectionSampler
from pieceworks.worker.spec_decode.verify_batch import verify_rows
from pieceworks.worker.step_inputs import StepInputs
from pieceworks.worker.structured_output import GrammarMask, GrammarSource

# Step plans kept (one per batch shape: token count, requests, longest query, uniform decode)
# before the cache starts over; decode shapes are few, prefill and mixed ones many.
MAX_CACHED_PLANS = 4096


class ModelRunner:
    """Loads the model, builds its step inputs, graphs and decode tails (``GraphCapture``), and
    executes steps. One per rank."""

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
        scheduler_config = config.scheduler_config
        self.max_num_tokens = max(
            scheduler_config.max_num_batched_tokens, self.compilation.max_capture_size
        )
        max_model_len = config.model_config.max_model_len or 0
        self.block_size = config.cache_config.block_size
        spec = config.speculative_config
        # Tokens a request gets per step: one per step of a run, or 1 + k verified.
        tokens_per_request = max(
            scheduler_config.num_scheduler_steps, 1 + (spec.num_speculative_tokens if spec else 0)
        )
        max_num_logits = scheduler_config.max_num_seqs * tokens_per_request
        buffers = InputBuffers(
            self.max_num_tokens,
            scheduler_config.max_num_seqs,
            cdiv(max_model_len, self.block_size),
            self.device,
            self.platform.pin_memory(),
            self.platform.create_event,
            max_num_steps=scheduler_config.num_scheduler_steps,
            max_num_logits=max_num_logits,
        )
        self.inputs = StepInputs(buffers, self.block_size)
        self.grammar_mask = GrammarMask(self.platform.pin_memory(), max_num_logits)
        self.graphs = GraphCapture(
            self.model, config, self.platform, self.dispatcher, self.inputs, self.kernels
        )
        self.forward_model = self.graphs.forward_model
        # The last launched step's sampled ids (device) and each request's row in them.
        self.last_sampled: torch.Tensor | None = None
        self.last_sampled_rows: dict[str, int] = {}
        self._token_staging = [
            torch.zeros(
                max_num_logits,
                dtype=torch.int64,
                pin_memory=self.platform.pin_memory(),
            )
            for _ in range(2)
        ]
        self._token_events = [self.platform.create_event() for _ in range(2)]
        self._num_steps = 0
        self._plans: dict[tuple[int, int, int, int], Any] = {}  # batch shape -> plan()
        self.mamba_spec = mamba_cache_spec(config)
        # State slots the scheduler hands out (0: no Mamba layers, no slots).
        self.num_state_slots = self.mamba_spec.num_slots if self.mamba_spec else 0
        # Every attention layer's window (None: some layer sees the whole context).
        self.sliding_window = freeable_sliding_window(config)
        self.profiler = KVCacheProfiler(
            config, self.platform, self.device, self.graphs, self.mamba_spec, self.max_num_tokens
        )
        self.num_blocks = 0
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self.generators: dict[str, torch.Generator | None] = {}

    # --- start-up ----------------------------------------------------------------------------
    def initialize_kv_cache(self) -> int:
        """Compile (first forward, largest size), measure its peak, allocate the KV cache; the
        number of blocks (``KVCacheProfiler``)."""
        self.num_blocks = self.profiler.initialize_kv_cache()
        return self.num_blocks

    def capture_model(self) -> None:
        """Warm every batch shape up, then capture every graph (``GraphCapture``)."""
        self.graphs.capture_model()

    def release_graphs(self) -> int:
        """Drop every static graph this runner captured (at shutdown); how many."""
        return self.graphs.release_graphs()

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
            output.uniform_decode_query_len,
        )
        planned = self._plans.get(key)
        if planned is None:
            if len(self._plans) >= MAX_CACHED_PLANS:
                self._plans.clear()
            planned = self._plans[key] = self._plan(*key)
        return planned

    def _plan(
        self, num_tokens: int, num_seqs: int, max_query_len: int, uniform_query_len: int
    ) -> tuple[StepShape, CUDAGraphMode, BatchDescriptor | None]:
        if uniform_query_len > 1 and num_seqs <= self.compilation.max_capture_size:
            # A uniform verify batch: padded by sequences, each 1 + k tokens.
            padded_seqs = self.compilation.pad_for_cudagraph(num_seqs)
            verify = BatchDescriptor(padded_seqs * uniform_query_len, True, uniform_query_len)
            if verify in self.dispatcher.cudagraph_keys[CUDAGraphMode.FULL]:
                return self._full_shape(verify, num_tokens, num_seqs), CUDAGraphMode.FULL, verify
        uniform = uniform_query_len == 1
        if num_tokens <= self.compilation.max_capture_size:
            padded = self.compilation.pad_for_cudagraph(num_tokens)
            mode, descriptor = self.dispatcher.dispatch(BatchDescriptor(padded, uniform))
        else:
            padded, mode, descriptor = num_tokens, CUDAGraphMode.NONE, None
        if mode == CUDAGraphMode.FULL:
            assert descriptor is not None
            return self._full_shape(descriptor, num_tokens, num_seqs), mode, descriptor
        if mode == CUDAGraphMode.NONE:
            padded = num_tokens
        return StepShape(num_tokens, padded, num_seqs, num_seqs, max_query_len), mode, descriptor

    def _full_shape(self, descriptor: BatchDescriptor, num_tokens: int, num_seqs: int) -> StepShape:
        """The layout a FULL graph was captured with, holding the real batch."""
        shape = self.graphs.capture_shape(descriptor)
        return dataclasses.replace(shape, num_tokens=num_tokens, num_seqs=num_seqs)

    def execute(self, output: SchedulerOutput, grammar: GrammarSource | None = None) -> list[int]:
        """Run one scheduled step; return one sampled token per request that produces one."""
        return self.execute_async(output, grammar).tolist()  # the step's one host sync

    @torch.inference_mode()
    def execute_async(
        self, output: SchedulerOutput, grammar: GrammarSource | None = None
    ) -> SampledTokens:
        """Launch one scheduled step; the handle gives its sampled tokens (one per producing
        request, in scheduled order) once the device has them, and the log-probabilities of the
        requests that asked for them.

        ``grammar``, for a step with a structured-output request, gives the step's token bitmask
        (one row per producing request, or None): it is called once, after the forward (and,
        outside decode tails, the logits) is launched, so the host fills the bitmask while the
        device runs the forward; the constrained rows are masked before sampling, in the masked
        decode tail where the step would run tails, else before the host sampler.
        """
        step = self._prepare(output)
        params, generators, rows = self._sampling_inputs(output)
        if self._uses_decode_tail(output, step, params):
            token_ids = self._run_decode_tails(step, output.num_steps, grammar)
            return self._finish_launch(token_ids, rows)
        hidden_states = self._run_model(step)
        prompt = step_prompt_logprobs(
            output.scheduled_requests, hidden_states, self.model.compute_logits
        )
        if self.inputs.num_logits == 0:
            if grammar is not None:
                grammar()  # called once per step all the same (tensor-parallel ranks pair on it)
            return SampledTokens(None, None, prompt_logprobs=prompt)
        logits = self.model.compute_logits(self.inputs.logits_rows(hidden_states))  # (S, V)
        bitmask = grammar() if grammar is not None else None
        if bitmask is not None:  # structured output: constrained rows masked
            self.grammar_mask.apply(logits, verify_rows(output, bitmask), self._num_steps)
        if output.num_verify_columns > 1:  # (R, V): 1 + s rows per request verifying s
            token_ids, logprobs = self.rejection_sampler.verify_step(
                output, logits, params, generators
            )
            return self._finish_launch(token_ids, rows, logprobs, prompt)
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
        only that fill its size, every row greedy, no log-probabilities asked for (those need the
        host sampler path), no logit bias; constrained rows are masked in the masked tail."""
        descriptor = step.descriptor
        return (
            step.mode == CUDAGraphMode.FULL
            and descriptor in self.graphs.decode_tail_descriptors
            and output.is_uniform_decode
            and descriptor.num_tokens == output.num_requests == len(params)
            and all(param.is_greedy and param.logprobs is None for param in params)
            and not has_logit_bias(params)  # the tail's argmax is of the unbiased logits
        )

    def _run_decode_tails(
        self, step: _PreparedStep, num_steps: int, grammar: GrammarSource | None = None
    ) -> torch.Tensor:
        """Each step of the run: its FULL graph, then the tail of its index, which samples into
        ``sampled_steps`` and advances the buffers to the next step. Every step's ids, step 0's
        first: (num_steps * S,), a view of ``sampled_steps``. Every step runs under the same
        forward context (the FULL graph's mode and descriptor, which select the tails' graphs).
        With ``grammar`` (a one-step run) the step's bitmask, asked for once the forward is
        launched, goes to the masked tail's buffer and that tail samples."""
        inputs, tails = self.inputs.model_inputs(step.shape), self.graphs.decode_tails
        with set_forward_context(
            step.metadata,
            self.config,
            cudagraph_runtime_mode=step.mode,
            batch_descriptor=step.descriptor,
        ):
            assert grammar is None or num_steps == 1  # a constrained step runs alone
            for index in range(num_steps):
                hidden_states = self.forward_model(*inputs)
                bitmask = grammar() if grammar is not None else None
                if bitmask is None:
                    tails[index](hidden_states)
                    continue
                assert self.graphs.grammar_bitmask is not None
                self.grammar_mask.stage(bitmask, self._num_steps, self.graphs.grammar_bitmask)
                self.graphs.masked_decode_tail(hidden_states)
        assert step.descriptor is not None
        return self.inputs.buffers.sampled_steps[: num_steps * step.descriptor.num_tokens]

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
            self.inputs.advance_decode(sampled[-1], index)
            hidden_states = self._run_model(step)
            logits = self.model.compute_logits(self.inputs.logits_rows(hidden_states))
            token_ids = self.sampler.sample(logits, params, generators, row_params)
            sampled.append(same_on_every_rank(token_ids))
        return torch.cat(sampled)

    @torch.inference_mode()
    def compute_logits(self, output: SchedulerOutput) -> torch.Tensor | None:
        """Forward one step; the logits (S, V) of the requests that produce a token, in the LM
        head's dtype."""
        hidden_states = self.forward(output)
        if self.inputs.num_logits == 0:
            return None
        return self.model.compute_logits(self.inputs.logits_rows(hidden_states))  # (S, V)

    def forward(self, output: SchedulerOutput) -> torch.Tensor:
        """Lay the step into the buffers and run the model; the hidden states of every row."""
        return self._run_model(self._prepare(output))

    def _prepare(self, output: SchedulerOutput) -> _PreparedStep:
        """Plan the step and lay it into the buffers, placeholder tokens filled on the device."""
        shape, mode, descriptor = self.plan(output)
        metadata = self.inputs.prepare(
            output.scheduled_requests,
            shape,
            self.last_sampled_rows,
            output.num_steps,
            self.last_sampled,
        )
        return _PreparedStep(metadata, shape, mode, descriptor)

    def _run_model(self, step: _PreparedStep) -> torch.Tensor:
        """The forward of a prepared step on what the buffers hold now."""
        with set_forward_context(
            step.metadata,
            self.config,
            cudagraph_runtime_mode=step.mode,
            batch_descriptor=step.descriptor,
        ):
            return self.forward_model(*self.inputs.model_inputs(step.shape))

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
