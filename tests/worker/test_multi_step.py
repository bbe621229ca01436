"""Multi-step decode in the scheduler: an output of K decode steps gives K single steps' tokens.

With ``num_scheduler_steps`` K > 1 a batch of decodes only becomes one output of up to K steps. A
fake runner (``tests/scheduler/test_scheduler.py``'s paged "KV cache" and Mamba "state", here run K
times per output, each step's sampled token fed to the next on its "device") drives random
workloads with arrivals over time, EOS and stop ids, ``max_tokens`` that are no multiple of K,
aborts while a run is in flight, and a block pool small enough to preempt; synchronously and
with async scheduling. Proved: every request ends with the tokens and finish reason of a run
without any scheduler (so of K=1); the tokens sampled after a stop are dropped and their blocks
freed (nothing leaks); every run stays within ``max_tokens`` and has the KV blocks of all its
steps; outputs of more than one step are uniform decodes; a waiting request that can take a seat
is admitted by the next ``schedule()``; logprobs requests, prefills and a short block pool fall
back to single steps.

Run: pytest tests/worker/test_multi_step.py
"""

from __future__ import annotations

import random

import pytest

from pieceworks.config import CacheConfig, SchedulerConfig
from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.block_manager import cdiv
from pieceworks.scheduler.output import PLACEHOLDER_TOKEN_ID, SchedulerOutput
from pieceworks.scheduler.request import Request, RequestStatus
from pieceworks.scheduler.scheduler import Scheduler
from tests.scheduler.test_scheduler import (
    EOS_TOKEN_ID,
    FakeModelRunner,
    check_no_leaks,
    next_token,
    random_requests,
    reference_output,
    rolling_hash,
)


def make_scheduler(
    num_scheduler_steps: int,
    async_scheduling: bool,
    max_num_seqs: int = 4,
    num_blocks: int = 256,
    num_state_slots: int = 0,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=64,
            num_scheduler_steps=num_scheduler_steps,
        ),
        CacheConfig(block_size=4),
        max_model_len=256,
        num_blocks=num_blocks,
        num_state_slots=num_state_slots,
        async_scheduling=async_scheduling,
    )


class MultiStepFakeRunner(FakeModelRunner):
    """The fake runner, running a multi-step output's steps back to back: step i + 1 reads step
    i's sampled token from its own "device" copy, as ``ModelRunner._decode_steps`` does."""

    def execute(self, output: SchedulerOutput) -> list[int]:
        if output.num_steps == 1:
            return super().execute(output)
        scheduled = output.scheduled_requests
        assert output.is_uniform_decode
        inputs = {
            item.request.request_id: (
                self.last_sampled[item.request.request_id]
                if item.new_token_ids[0] == PLACEHOLDER_TOKEN_ID
                else item.new_token_ids[0]
            )
            for item in scheduled
        }
        sampled: list[int] = []
        for step in range(output.num_steps):
            for item in scheduled:  # every KV write of the step before any read
                position = item.num_computed_tokens + step
                self.kv_cache[self.slot(item.request, position)] = inputs[item.request.request_id]
            for item in scheduled:
                request, position = item.request, item.num_computed_tokens + step
                context = [self.kv_cache[self.slot(request, p)] for p in range(position + 1)]
                known = request.all_token_ids[: position + 1]
                assert context[: len(known)] == known, f"{request.request_id}: KV corrupted"
                if self.state_cache:
                    slot = request.state_slot
                    state = rolling_hash([context[-1]], self.state_cache[slot])
                    assert state == rolling_hash(context), "Mamba state slot shared or stale"
                    self.state_cache[slot] = state
                inputs[request.request_id] = next_token(context)
                sampled.append(inputs[request.request_id])
        self.last_sampled = dict(inputs)
        return sampled


def check_output(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """A run has the blocks of all its steps and never passes a request's max_tokens."""
    assert output.num_steps <= scheduler.num_scheduler_steps
    if output.num_steps > 1:
        assert output.is_uniform_decode
    for item in output.scheduled_requests:
        request = item.request
        needed = item.num_computed_tokens + item.num_new_tokens + output.num_steps - 1
        assert len(request.block_ids) >= cdiv(needed, scheduler.block_manager.block_size)
        max_tokens = request.sampling_params.max_tokens
        assert needed <= request.num_prompt_tokens + max_tokens - 1, request.request_id
        assert request.num_output_tokens + request.num_output_placeholders <= max_tokens


def drive(
    scheduler: Scheduler,
    arrivals: dict[int, list[Request]],
    aborts: dict[int, list[str]] | None = None,
    max_calls: int = 20_000,
) -> list[SchedulerOutput]:
    """schedule → fake runner → update until all finish, as ``EngineCore.step`` does; requests
    arrive (and are aborted) before the numbered ``schedule()`` call. The launched outputs."""
    runner, aborts = MultiStepFakeRunner(scheduler), aborts or {}
    outputs: list[SchedulerOutput] = []
    in_flight: tuple[SchedulerOutput, list[int]] | None = None
    for call in range(max_calls):
        for request in arrivals.get(call, []):
            scheduler.add_request(request)
        scheduler.finish_requests(aborts.get(call, []), RequestStatus.FINISHED_ABORTED)
        if call > max(arrivals) and not scheduler.has_unfinished_requests() and not in_flight:
            break
        output = scheduler.schedule()
        launched = None
        if output.scheduled_requests:
            check_output(scheduler, output)
            launched = (output, runner.execute(output))
            outputs.append(output)
        if in_flight is not None:
            scheduler.update_from_output(*in_flight)
        in_flight = launched
        if scheduler.max_pending_outputs == 1 and in_flight is not None:
            scheduler.update_from_output(*in_flight)
            in_flight = None
    check_no_leaks(scheduler)
    return outputs


def fresh(requests: list[Request]) -> list[Request]:
    return [
        Request(r.request_id, r.prompt_token_ids, r.sampling_params, EOS_TOKEN_ID) for r in requests
    ]


def staggered(requests: list[Request], seed: int) -> dict[int, list[Request]]:
    """The requests spread over the first 30 calls, in order."""
    rng = random.Random(seed)
    arrivals: dict[int, list[Request]] = {}
    calls = sorted(rng.randrange(30) for _ in requests)
    for call, request in zip(calls, requests):
        arrivals.setdefault(call, []).append(request)
    return arrivals


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_scheduler_steps", [2, 4, 8])
@pytest.mark.parametrize("seed", range(3))
def test_random_workloads_give_the_single_step_tokens(seed, num_scheduler_steps, async_scheduling):
    requests = random_requests(seed, num_requests=24, max_tokens=30)
    single = fresh(requests)
    drive(make_scheduler(1, async_scheduling), staggered(single, seed))
    scheduler = make_scheduler(num_scheduler_steps, async_scheduling)
    outputs = drive(scheduler, staggered(requests, seed))
    for request, reference in zip(requests, single):
        assert (request.output_token_ids, request.finish_reason) == reference_output(request)
        assert request.output_token_ids == reference.output_token_ids
    assert any(output.num_steps == num_scheduler_steps for output in outputs)


def tokens_sampled(outputs: list[SchedulerOutput], request_id: str) -> int:
    """How many tokens the runs sampled for a request (its dropped ones included)."""
    return sum(
        output.num_steps
        for output in outputs
        for item in output.producing_requests
        if item.request.request_id == request_id
    )


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_stop_token_in_the_middle_of_a_run_ends_the_request_there(async_scheduling):
    """The stop id is the 7th token: the prefill samples token 1, runs of 4 tokens 2-5 and 6-9."""
    prompt = [3, 1, 4, 1, 5]
    free_run = Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    expected = reference_output(free_run)[0]
    stop_id = expected[6]
    assert stop_id not in expected[:6]  # the fake model's tokens for this prompt
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                            stop_token_ids=[stop_id])  # fmt: skip
    request = Request("r", prompt, params, EOS_TOKEN_ID)
    other = Request("o", [2, 7], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    outputs = drive(make_scheduler(4, async_scheduling), {0: [request, other]})
    assert request.output_token_ids == expected[:7] and request.finish_reason == "stop"
    assert [output.num_steps for output in outputs[:3]] == [1, 4, 4]
    assert tokens_sampled(outputs, "r") > 7  # sampled past the stop, dropped
    assert other.output_token_ids == reference_output(other)[0]


def test_max_tokens_no_multiple_of_the_steps_shortens_the_last_run():
    """max_tokens 11: the prefill's token, runs of 4 and 4, then one of the 2 left."""
    params = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True)
    request = Request("r", [9, 8, 7], params, EOS_TOKEN_ID)
    outputs = drive(make_scheduler(4, async_scheduling=False), {0: [request]})
    assert [output.num_steps for output in outputs] == [1, 4, 4, 2]
    assert request.output_token_ids == reference_output(request)[0]
    assert request.finish_reason == "length"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_abort_while_a_run_is_in_flight_drops_its_tokens_and_frees_its_blocks(
    async_scheduling,
):
    requests = [
        Request(f"r{i}", [i + 1] * (3 + i), SamplingParams(temperature=0.0, max_tokens=30,
                ignore_eos=True), EOS_TOKEN_ID)
        for i in range(3)
    ]  # fmt: skip
    scheduler = make_scheduler(4, async_scheduling)
    outputs = drive(scheduler, {0: requests}, aborts={4: ["r1"]})
    aborted = requests[1]
    assert aborted.finish_reason == "abort"
    reference = reference_output(Request("x", aborted.prompt_token_ids, aborted.sampling_params))
    assert 0 < aborted.num_output_tokens < 30
    assert aborted.output_token_ids == reference[0][: aborted.num_output_tokens]
    assert any(o.num_steps == 4 for o in outputs)
    for request in (requests[0], requests[2]):
        assert (request.output_token_ids, request.finish_reason) == reference_output(request)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_state_slots", [0, 5])
@pytest.mark.parametrize("seed", range(3))
def test_preemption_with_multi_step_keeps_the_tokens(seed, num_state_slots, async_scheduling):
    """6 blocks of 4 tokens: runs fall back to single steps when their blocks are short, and
    requests are preempted by recompute as without multi-step."""
    requests = random_requests(seed, num_requests=12, max_prompt_len=15, max_tokens=10)
    scheduler = make_scheduler(4, async_scheduling, num_blocks=6, num_state_slots=num_state_slots)
    outputs = drive(scheduler, staggered(requests, seed))
    assert sum(len(output.preempted_requests) for output in outputs) > 0
    assert any(output.num_steps > 1 for output in outputs)
    for request in requests:
        assert (request.output_token_ids, request.finish_reason) == reference_output(request)


def test_a_request_that_can_take_a_seat_is_admitted_by_the_next_schedule():
    scheduler = make_scheduler(8, async_scheduling=False, max_num_seqs=2)
    runner = MultiStepFakeRunner(scheduler)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    first = Request("first", [1, 2, 3], params, EOS_TOKEN_ID)
    scheduler.add_request(first)
    for _ in range(2):  # the prefill, then a run of 8
        output = scheduler.schedule()
        scheduler.update_from_output(output, runner.execute(output))
    assert output.num_steps == 8
    scheduler.add_request(Request("late", [4, 5], params, EOS_TOKEN_ID))
    output = scheduler.schedule()
    assert output.num_steps == 1
    assert [item.request.request_id for item in output.scheduled_requests] == ["first", "late"]
    scheduler.update_from_output(output, runner.execute(output))
    # Both decode now; a third request finds no seat, so it does not stop the runs.
    scheduler.add_request(Request("waits", [6], params, EOS_TOKEN_ID))
    assert scheduler.schedule().num_steps == 8


def test_logprobs_requests_and_prefills_run_single_steps():
    scheduler = make_scheduler(4, async_scheduling=False)
    runner = MultiStepFakeRunner(scheduler)
    logprobs = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    scheduler.add_request(Request("lp", [1, 2], logprobs, EOS_TOKEN_ID))
    scheduler.add_request(Request("plain", [3, 4], plain, EOS_TOKEN_ID))
    steps = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        steps.append(output.num_steps)
        scheduler.update_from_output(output, runner.execute(output))
    assert steps == [1] * 20  # one prefill and 19 decodes of both, none multi-step


def test_a_run_needs_one_token_per_request_per_step():
    scheduler = make_scheduler(4, async_scheduling=False)
    runner = MultiStepFakeRunner(scheduler)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    scheduler.add_request(Request("a", [1, 2], params, EOS_TOKEN_ID))
    output = scheduler.schedule()
    scheduler.update_from_output(output, runner.execute(output))
    output = scheduler.schedule()
    assert output.num_steps == 4
    with pytest.raises(ValueError) as error:
        scheduler.update_from_output(output, [5, 6])
    assert str(error.value) == (
        "got 2 sampled tokens for 4 decode steps of 1 requests; pass 4 tokens per request, "
        "step by step"
    )


def test_detached_output_keeps_its_number_of_steps():
    scheduler = make_scheduler(4, async_scheduling=False)
    runner = MultiStepFakeRunner(scheduler)
    scheduler.add_request(Request("a", [1], SamplingParams(max_tokens=9, ignore_eos=True)))
    output = scheduler.schedule()
    scheduler.update_from_output(output, runner.execute(output))
    output = scheduler.schedule()
    assert output.num_steps == output.detached().num_steps == 4


def test_num_scheduler_steps_below_one_is_refused():
    with pytest.raises(ValueError, match="num_scheduler_steps=0 must be at least 1"):
        SchedulerConfig(num_scheduler_steps=0)
