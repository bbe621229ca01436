"""``Request``: one prompt's state as it moves through the scheduler, and its ``RequestStatus``.

Owns the token bookkeeping the scheduler and the model runner share: the prompt, the generated
tokens, how many of them already have their KV (and Mamba state) computed, and which KV blocks and
state slot hold that cache, and the prefix-cache hashes of its full blocks. It does not allocate
anything itself: ``BlockManager`` and ``StateSlotManager`` fill ``block_ids`` and ``state_slot``
(``block_hash.py`` fills ``block_hashes``); the scheduler moves ``status``. Its
``priority`` and ``arrival_time`` are what a scheduling policy orders it by. ``check_stop`` says
whether a newly appended token ends it.
"""

from __future__ import annotations

import dataclasses
import enum
import time

from pieceworks.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One token position on the host: the chosen token's log-probability and rank, and the
    top-k (ids and log-probabilities, most likely first)."""

    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


class RequestStatus(enum.Enum):
    """Where a request is: queued, running, preempted (back in the queue), or finished."""

    # The finished statuses come last: ``is_finished`` compares values (checked per request per
    # step, so it avoids hashing the member).
    WAITING = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4  # EOS or a stop token
    FINISHED_LENGTH_CAPPED = 5  # max_tokens generated
    FINISHED_ABORTED = 6  # aborted by the caller (a client went away)

    @property
    def is_finished(self) -> bool:
        return self._value_ >= _FIRST_FINISHED_VALUE


_FIRST_FINISHED_VALUE = RequestStatus.FINISHED_STOPPED.value
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclasses.dataclass(eq=False)
class Request:
    """A prompt and its generated tokens, with the cache state the scheduler tracks for it.

    Invariant: the first ``num_computed_tokens`` of its tokens have their KV written (or are
    being written by a step already launched) in ``block_ids`` (and, for hybrid models, their
    recurrent state folded into ``state_slot``), except blocks wholly before a sliding window,
    which may have been freed (``BlockManager.FREED_BLOCK_ID`` entries). A decoding request has
    exactly one uncomputed token: the one sampled last step. With async scheduling that token may
    still be on the device: ``num_output_placeholders`` counts sampled tokens the host has not
    seen yet (one per decode step in flight, so ``num_steps`` per multi-step output); they count
    in ``num_tokens`` but not in ``output_token_ids``. Preemption resets ``num_computed_tokens``
    to 0 but keeps ``output_token_ids``, so on resume the prompt and the generated tokens are
    recomputed together as one prefill (less what the prefix cache holds).

    ``block_hashes[i]`` names the content of full block ``i`` of its known tokens (the prefix
    cache's key); the first ``num_cached_blocks`` of ``block_ids`` are registered in the prefix
    cache (found there on admission, or registered once their KV was computed).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    # The model's further EOS ids (a config listing several: Gemma's <end_of_turn>), which stop
    # the request like eos_token_id, unless ignore_eos.
    extra_eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = dataclasses.field(default_factory=list)
    state_slot: int | None = None  # Mamba state slot; only for models with Mamba layers
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    num_preemptions: int = 0
    num_output_placeholders: int = 0  # sampled on the device, not yet known on the host
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_cached_blocks: int = 0
    # Per output token, when sampling_params.logprobs is set; per prompt token (the first None)
    # when sampling_params.prompt_logprobs is set. The engine fills both as steps come back.
    output_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = dataclasses.field(default_factory=lambda: [None])
    # The priority policy schedules lower values first, ties by arrival (scheduler/policy.py).
    priority: int = 0
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    # A proposer's guesses for the tokens after the last one (speculative decoding), set by the
    # engine before each step; the scheduler verifies as many as fit.
    spec_token_ids: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens, those still on the device included."""
        return (
            len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_output_placeholders
        )

    @property
    def num_tokens_known(self) -> int:
        """Prompt plus generated tokens the host has (those still on the device left out)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens whose KV is not computed yet (1 for a decode, more for a prefill)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def reaches_max_tokens(self) -> bool:
        """Its tokens on the device already make ``max_tokens``: scheduling it again would
        overrun (its pending token is its last)."""
        return (
            self.num_output_placeholders > 0
            and len(self.output_token_ids) + self.num_output_placeholders
            >= self.sampling_params.max_tokens
        )

    def runner_view(self) -> Request:
        """What a model runner reads of this request, without its tokens (sent to other ranks)."""
        view = Request(self.request_id, [], self.sampling_params, self.eos_token_id)
        view.block_ids, view.state_slot = list(self.block_ids), self.state_slot
        return view

    def drop_output_after(self, num_output_tokens: int) -> None:
        """Keep only the first ``num_output_tokens`` generated tokens (and their logprobs): the
        text reached a stop string there, and the tokens a multi-step run sampled after it are
        past the request's end."""
        del self.output_token_ids[num_output_tokens:]
        del self.output_logprobs[num_output_tokens:]
        self.block_hashes.clear()  # some named dropped tokens; recomputed if ever needed

    def finish(self, status: RequestStatus) -> None:
        """Mark the request finished with ``status`` and set its ``finish_reason``."""
        self.status = status
        self.finish_reason = _FINISH_REASONS[status]


def check_stop(request: Request, token_id: int) -> RequestStatus | None:
    """Stop on EOS (unless ignore_eos) or a stop token, else on max_tokens (stops win)."""
    params = request.sampling_params
    if not params.ignore_eos and (
        token_id == request.eos_token_id or token_id in request.extra_eos_token_ids
    ):
        return RequestStatus.FINISHED_STOPPED
    if token_id in params.stop_token_ids:
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
