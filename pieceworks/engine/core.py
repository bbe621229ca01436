"""``EngineCore``: the step loop joining the scheduler, the executor and the sampler.

As in vLLM, the engine core is the inner loop that owns the scheduler and the executor; ``LLM``
(``engine/llm.py``) drives it directly, and the server reaches it through ``EngineCoreLoop``
(``engine/core_loop.py``) on a thread or in the engine process (``engine/core_process.py``).

``add_request`` validates and queues; ``step`` schedules one batch, launches it, and feeds sampled
tokens back; finished requests come back from ``step``. With ``async_scheduling`` (the default)
``step`` launches its batch and then waits for the previous step's tokens, so the host schedules
and prepares step N+1 while the device still runs step N; the tokens of a step, and the requests
it finishes, then come back from the next ``step`` call. With ``num_scheduler_steps`` K > 1 a
batch of decodes only is one multi-step output: one ``step`` call launches K decode steps and
later reads their K tokens per request at once (the scheduler applies them in step order).
With a ``speculative_config`` a proposer guesses each decoding request's next tokens before the
step is scheduled (``Request.spec_token_ids``); the step verifies them and may append several
tokens per request (docs/engine.md, "Speculative decoding"); under async scheduling a step's
tokens are read at once only where speculation needs them (``_proposes_next``).
Start-up (load, compile, KV cache, capture) happens in the constructor and is timed for the report.

A request with ``SamplingParams.structured_outputs`` has its grammar compiled when it is added
(a ValueError if it does not compile); the engine loop adds with ``defer_grammar``, so that
the first such request, which builds the grammar compiler (seconds), waits for it on a thread
while the engine steps the others. Once the runner has launched a step's forward it asks for
the step's token bitmask (``_grammar_source``), which the engine fills while the device runs;
such a step never runs as a multi-step output, and ``num_constrained_steps`` counts them.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import TYPE_CHECKING

from pieceworks.config import CompilationLevel, EngineConfig
from pieceworks.core.compiler_interface import check_inductor_cache_dir
from pieceworks.engine.arg_utils import draft_engine_config
from pieceworks.engine.grammar_waitlist import GrammarWaitlist
from pieceworks.engine.step_logprobs import drop_logprobs_past_stops, record_logprobs
from pieceworks.logger import init_logger
from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.block_hash import model_identity
from pieceworks.scheduler.output import SchedulerOutput
from pieceworks.scheduler.request import Request, RequestStatus
from pieceworks.scheduler.scheduler import Scheduler
from pieceworks.worker.executor import make_executor
from pieceworks.worker.sampled_tokens import SampledTokens
from pieceworks.worker.spec_decode import make_proposer
from pieceworks.worker.spec_decode.backoff import ProposalBackoff
from pieceworks.worker.spec_decode.proposer import propose_for_running, tokens_needed_next
from pieceworks.worker.structured_output import GrammarSource, StructuredOutputManager

if TYPE_CHECKING:
    import torch

logger = init_logger(__name__)

# Step timings an engine keeps (``EngineCore.step_seconds``): far more than one benchmark run's
# decode steps, a few MiB at most.
MAX_STEP_TIMINGS = 65_536

# One engine builds or steps at a time in a process: the forward context, Dynamo's state and graph
# capture are process-wide, so two engines driven from two threads take turns, step by step.
_ENGINE_LOCK = threading.RLock()


class EngineCore:
    """Queues requests, schedules one batch per ``step``, runs it on the executor and feeds the
    sampled tokens back to the scheduler; ``shutdown`` frees the graphs and the workers."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        compilation = config.compilation_config
        if compilation.level != CompilationLevel.NO_COMPILATION and compilation.backend != "eager":
            check_inductor_cache_dir()
        with _ENGINE_LOCK:
            self.executor = make_executor(config)
        self.runner = self.executor.runner  # this process's (rank 0's) runner
        num_blocks = self.runner.num_blocks
        max_model_len = config.model_config.max_model_len
        assert max_model_len is not None
        self.scheduler = Scheduler(
            config.scheduler_config,
            config.cache_config,
            max_model_len,
            num_blocks,
            num_state_slots=self.runner.num_state_slots,  # Mamba state slots (hybrid models)
            async_scheduling=config.scheduler_config.async_scheduling,
            model_identity=model_identity(config.model_config),
            sliding_window=self.runner.sliding_window,  # frees KV blocks outside the window
        )
        self.async_scheduling = config.scheduler_config.async_scheduling
        spec = config.speculative_config
        with _ENGINE_LOCK:
            draft_config = draft_engine_config(config)  # None unless a draft model proposes
            self.proposer = make_proposer(spec, draft_config) if spec is not None else None
        # Under async scheduling: which requests to propose for, so that steps between tries
        # need no host sync (``worker/spec_decode/backoff.py``).
        self.proposal_backoff = ProposalBackoff.for_engine(self.proposer, self.async_scheduling)
        # The launched step whose tokens have not been read yet (async scheduling).
        self._in_flight: tuple[SchedulerOutput, SampledTokens] | None = None
        # The step whose tokens are being applied (a failure there abandons it too).
        self._applying: SchedulerOutput | None = None
        self.eos_token_id = config.model_config.hf_config.get("eos_token_id")
        self.extra_eos_token_ids: tuple[int, ...] = ()
        if isinstance(self.eos_token_id, list):
            self.eos_token_id, *extra = self.eos_token_id
            self.extra_eos_token_ids = tuple(extra)
        eos_token_ids = [t for t in [self.eos_token_id, *self.extra_eos_token_ids] if t is not None]
        self.structured_output = StructuredOutputManager(
            self._load_tokenizer,
            config.model_config.hf_config.get("vocab_size") or 0,
            eos_token_ids,
        )
        # Steps whose batch held a structured-output request (one step per round trip).
        self.num_constrained_steps = 0
        # Constrained requests added with ``defer_grammar`` before the grammar compiler is built.
        self.grammar_waitlist = GrammarWaitlist(self.structured_output)
        self._request_ids = itertools.count()
        self._shut_down = False
        # (uniform decode?, number of requests, wall seconds) of each recent decode step (a
        # multi-step call adds one entry per step, each its share of the call's time): at most
        # MAX_STEP_TIMINGS, the oldest half dropped when full (an engine serving for days).
        self.step_seconds: list[tuple[bool, int, float]] = []

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        defer_grammar: bool = False,
    ) -> Request:
        """Queue a request; one that can never fit raises ValueError saying why. ``priority``:
        lower is scheduled first under ``scheduling_policy="priority"`` (else it must be 0).

        ``defer_grammar`` (the engine loop's way): a structured-output request that arrives
        before the grammar compiler is built does not wait for it. The compiler is built on a
        thread while the engine steps the other requests, and the request joins the scheduler
        once its grammar compiles (``GrammarWaitlist``, ``engine/grammar_waitlist.py``)."""
        self._check_running()
        constraint = params.structured_outputs
        defer = defer_grammar and constraint is not None
        defer = defer and not self.structured_output.compiler_ready
        request = self._make_request(prompt_token_ids, params, request_id, priority, not defer)
        if not defer:
            self.scheduler.add_request(request)
            return request
        self.scheduler.check_request(request)  # what can never fit is refused now all the same
        self.grammar_waitlist.add(request)
        return request

    def add_requests(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Request]:
        """Queue several requests, all or none: every one is checked (vocabulary, length, KV
        capacity) before the first is queued, so a refused one leaves the engine as it was."""
        requests = self.check_requests(prompts, params)
        for request in requests:
            self.scheduler.add_request(request)
        return requests

    def check_requests(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        priorities: list[int] | None = None,
    ) -> list[Request]:
        """The requests ``add_requests`` would queue, each checked (vocabulary, length, KV
        capacity, priority) with the prompt's index in the error; nothing is queued."""
        self._check_running()
        priorities = priorities or [0] * len(prompts)
        requests = [
            self._make_request(ids, p, None, priority)
            for ids, p, priority in zip(prompts, params, priorities)
        ]
        for index, request in enumerate(requests):
            try:
                self.scheduler.check_request(request)
            except ValueError as error:
                raise ValueError(f"prompt {index}: {error}") from None
        return requests

    def _make_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None,
        priority: int = 0,
        compile_grammar: bool = True,
    ) -> Request:
        vocab_size = self.config.model_config.hf_config.get("vocab_size")
        if vocab_size is not None:
            ids = prompt_token_ids  # min and max, not a Python loop over every token
            if ids and (min(ids) < 0 or max(ids) >= vocab_size):
                raise ValueError(f"prompt token ids must be in [0, {vocab_size}) for this model")
            params.check_vocabulary(vocab_size)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(
                f"priority must be an int (lower is scheduled first), not {priority!r}"
            )
        if params.structured_outputs is not None and compile_grammar:
            self.structured_output.compile(params.structured_outputs)  # once per grammar
        return Request(
            request_id=request_id or str(next(self._request_ids)),
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            extra_eos_token_ids=self.extra_eos_token_ids,
            priority=priority,
        )

    def abort_request(self, request_id: str) -> bool:
        """Stop a queued or running request now, with ``finish_reason`` "abort", freeing its KV
        blocks and state slot; False if no unfinished request has that id."""
        self._check_running()
        if self.grammar_waitlist.finish(request_id, RequestStatus.FINISHED_ABORTED):
            return True
        aborted = self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        for request in aborted:
            self._release(request.request_id)
        return bool(aborted)

    def stop_request(self, request_id: str) -> bool:
        """Finish a request now with ``finish_reason`` "stop" (its text reached a stop string),
        freeing its cache as ``abort_request`` does; False if no unfinished request has that id."""
        self._check_running()
        if self.grammar_waitlist.finish(request_id, RequestStatus.FINISHED_STOPPED):
            return True
        stopped = self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_STOPPED)
        for request in stopped:
            self._release(request.request_id)
        return bool(stopped)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self._in_flight is not None
            or bool(self.grammar_waitlist)
        )

    def step(self) -> list[Request]:
        """Launch one scheduled batch; return the requests whose last token has come back.

        A step that raises leaves no half-done step behind: the requests of every step awaiting
        its tokens are aborted (``_abandon_pending_steps``) and a ``StepFailedError`` naming them
        is raised (an interrupt is re-raised as it is), so the next ``step`` starts clean.
        """
        self._check_running()
        try:
            with _ENGINE_LOCK:
                return self._step()
        except Exception as error:
            request_ids = self._abandon_pending_steps()
            raise StepFailedError(error, request_ids) from error
        except BaseException:  # Ctrl-C: abandon the step, let the interrupt through
            self._abandon_pending_steps()
            raise

    def _step(self) -> list[Request]:
        start = time.perf_counter()
        self.grammar_waitlist.admit(self.scheduler)
        if self.proposer is not None:
            propose_for_running(self.proposer, self.scheduler.running, self.proposal_backoff)
        output = self.scheduler.schedule()
        if not output.scheduled_requests:
            if self._in_flight is None and self.grammar_waitlist:
                self.grammar_waitlist.wait()  # only requests waiting for the compiler
            return self._finish_in_flight()  # nothing new to launch: only drain
        finished: list[Request] = []
        sampled = self.executor.execute_async(output, self._grammar_source(output, finished))
        finished += self._finish_in_flight()
        self._in_flight = (output, sampled)
        if not self.async_scheduling or self._proposes_next(output):
            finished += self._finish_in_flight()
        step_seconds = self.step_seconds
        if len(step_seconds) >= MAX_STEP_TIMINGS:
            del step_seconds[: MAX_STEP_TIMINGS // 2]
        seconds_per_step = (time.perf_counter() - start) / output.num_steps
        decodes_only = output.uniform_decode_query_len > 0  # verify batches included
        timing = (decodes_only, output.num_requests, seconds_per_step)
        step_seconds.extend([timing] * output.num_steps)
        return finished

    def _proposes_next(self, output: SchedulerOutput) -> bool:
        """Whether speculation needs this step's tokens now (``tokens_needed_next``)."""
        return self.proposer is not None and tokens_needed_next(
            output, self.proposal_backoff, self.scheduler.running
        )

    def _grammar_source(
        self, output: SchedulerOutput, finished: list[Request]
    ) -> GrammarSource | None:
        """For a step whose producing requests include a constrained one: what gives its token
        bitmask, which the runner asks for once it has launched the step's forward. The
        matchers need the previous step's tokens, so it first finishes that step (adding the
        requests it finished to ``finished``), then fills the bitmask: the host does both while
        the device runs this step's forward."""
        if not any(s.request.sampling_params.structured_outputs for s in output.producing_requests):
            return None

        def bitmask() -> torch.Tensor | None:
            finished.extend(self._finish_in_flight())
            output.grammar_bitmask = self.structured_output.grammar_bitmask(output)
            self.num_constrained_steps += 1
            return output.grammar_bitmask

        return bitmask

    def _finish_in_flight(self) -> list[Request]:
        """Wait for the launched step's tokens (the host sync) and hand them to the scheduler."""
        if self._in_flight is None:
            return []
        output, sampled = self._in_flight
        self._in_flight = None
        self._applying = output
        token_ids = sampled.tolist()
        record_logprobs(output, sampled, token_ids)
        finished = self.scheduler.update_from_output(output, token_ids)
        drop_logprobs_past_stops(output, sampled)  # a stop inside a verified run
        if output.grammar_bitmask is not None:  # a grammar that ended finishes its request
            ended = self.structured_output.finished_requests(
                [scheduled.request for scheduled in output.producing_requests]
            )
            ids = [request.request_id for request in ended]
            finished += self.scheduler.finish_requests(ids, RequestStatus.FINISHED_STOPPED)
        self._applying = None
        for request in finished:
            self._release(request.request_id)
        return finished

    def _abandon_pending_steps(self) -> list[str]:
        """Abort the requests of every scheduled step whose tokens have not been applied, and
        forget those steps; the ids of the requests aborted."""
        self._in_flight = None
        outputs = self.scheduler.drop_pending_outputs()
        if self._applying is not None:  # already taken off the scheduler's pending steps
            outputs.append(self._applying)
            self._applying = None
        request_ids = list(
            dict.fromkeys(
                scheduled.request.request_id
                for output in outputs
                for scheduled in output.scheduled_requests
            )
        )
        aborted = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for request in aborted:
            self._release(request.request_id)
        if aborted:
            logger.warning(
                "an engine step failed; aborted its %d request(s): %s",
                len(aborted),
                ", ".join(r.request_id for r in aborted),
            )
        return request_ids

    def _release(self, request_id: str) -> None:
        """Free a finished request's per-request state: generator, grammar matcher, proposer
        state."""
        self.executor.release(request_id)
        self.structured_output.release(request_id)
        if self.proposer is not None:
            self.proposer.release(request_id)
        if self.proposal_backoff is not None:
            self.proposal_backoff.release(request_id)

    def _load_tokenizer(self) -> object:
        from pieceworks.engine.tokenizer import load_tokenizer

        model_config = self.config.model_config
        return load_tokenizer(model_config.model, model_config.tokenizer)

    @property
    def is_shut_down(self) -> bool:
        return self._shut_down

    def _check_running(self) -> None:
        if self._shut_down:
            raise RuntimeError(
                "this engine was shut down (its graphs and workers are freed); build a new LLM"
            )

    def shutdown(self) -> None:
        """Free the captured graphs; stop tensor-parallel workers and free the process group."""
        self._shut_down = True
        with _ENGINE_LOCK:
            if self.proposer is not None:
                self.proposer.shutdown()
            self.executor.shutdown()


class StepFailedError(RuntimeError):
    """An engine step raised; the requests it was running (``request_ids``) were aborted and the
    engine is consistent again: its other requests carry on with the next ``step``."""

    def __init__(self, error: BaseException, request_ids: list[str]) -> None:
        super().__init__(
            f"an engine step failed ({type(error).__name__}: {error}); its requests were "
            f"aborted: {', '.join(request_ids) or 'none'}"
        )
        self.request_ids = request_ids
