"""A step's log-probabilities recorded on its requests, as the engine applies the step's tokens.

``EngineCore`` reads a step's tokens and log-probabilities together (``SampledTokens``);
``record_logprobs`` appends the entries before the scheduler appends the tokens, and
``drop_logprobs_past_stops`` removes, after it, the entries of a speculative step's tokens that
came after a stop (the scheduler drops those tokens).
"""

from __future__ import annotations

from pieceworks.scheduler.output import REJECTED_TOKEN_ID, SchedulerOutput
from pieceworks.worker.sampled_tokens import SampledTokens


def record_logprobs(output: SchedulerOutput, sampled: SampledTokens, token_ids: list[int]) -> None:
    """Append a step's log-probabilities to the requests that asked, before its tokens are.

    A sampled token's entry goes only where ``update_from_output`` will append the token (its
    request is not finished yet). Prompt entries continue where the request's list ends, so a
    prefill recomputed after a preemption adds nothing twice. A speculative step has
    ``num_verify_columns`` rows per request: one entry per token it produced
    (``drop_logprobs_past_stops`` removes those after a stop, once the tokens are applied).
    """
    if sampled.logprobs is None and sampled.prompt_logprobs is None:
        return  # nobody asked: nothing per request
    by_row = sampled.logprobs_by_row()
    columns = output.num_verify_columns
    for row, scheduled in enumerate(output.producing_requests):
        if scheduled.request.is_finished:
            continue
        for flat_row in range(row * columns, (row + 1) * columns):
            if flat_row in by_row and token_ids[flat_row] != REJECTED_TOKEN_ID:
                scheduled.request.output_logprobs.append(by_row[flat_row])
    prompt_rows = sampled.prompt_logprobs_by_request()
    if not prompt_rows:
        return
    for scheduled in output.scheduled_requests:
        request = scheduled.request
        if request.request_id not in prompt_rows:
            continue
        first, values = prompt_rows[request.request_id]
        have = len(request.prompt_logprobs)
        if first <= have:
            request.prompt_logprobs.extend(values[have - first :])


def drop_logprobs_past_stops(output: SchedulerOutput, sampled: SampledTokens) -> None:
    """After a speculative step's tokens are applied: each request keeps one entry per output
    token (a stop inside its verified run dropped the tokens after it)."""
    if output.num_verify_columns == 1 or sampled.logprobs is None:
        return
    for scheduled in output.producing_requests:
        request = scheduled.request
        del request.output_logprobs[request.num_output_tokens :]
