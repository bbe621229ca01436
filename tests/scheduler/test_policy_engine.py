"""The scheduling policy as an engine's caller sees it.

Proves: with ``scheduling_policy="priority"`` and a full batch (``max_num_seqs=1``), a
high-priority request added after a low-priority one is admitted first, while the default fcfs
engine admits them in arrival order; ``LLM.generate(priority=[...])`` hands each prompt's
priority to the engine, refuses a list of the wrong length, and under fcfs refuses a non-zero
priority with the prompt's index, queuing nothing; a priority that is not an int is refused.
llama-tiny at level 0 on CPU, float32.
Run: pytest tests/scheduler/test_policy_engine.py
"""

from __future__ import annotations

import pytest

from pieceworks.engine.llm import LLM
from pieceworks.sampling_params import SamplingParams

SHORT = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def make_llm(policy: str) -> LLM:
    return LLM(
        "llama-tiny",
        compilation_config={"level": 0},
        dtype="float32",
        max_model_len=64,
        max_num_seqs=1,
        scheduling_policy=policy,
    )


@pytest.fixture(scope="module")
def priority_llm():
    return make_llm("priority")


@pytest.fixture(scope="module")
def fcfs_llm():
    return make_llm("fcfs")


def admission_order(engine, priorities: dict[str, int]) -> list[str]:
    """Fill the one seat, queue the named requests behind it, and run; the order admitted."""
    engine.add_request([1, 2, 3], SHORT, request_id="seated")
    engine.step()
    admitted = [request.request_id for request in engine.scheduler.running]
    assert admitted == ["seated"]  # it holds the batch's only seat
    for request_id, priority in priorities.items():
        engine.add_request([4, 5], SHORT, request_id=request_id, priority=priority)
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            if request.request_id not in admitted:
                admitted.append(request.request_id)
    return admitted[1:]


def test_a_later_high_priority_request_is_admitted_first_when_the_batch_is_full(priority_llm):
    order = admission_order(priority_llm.engine, {"low": 5, "high": -1})
    assert order == ["high", "low"]


def test_fcfs_admits_in_arrival_order(fcfs_llm):
    assert admission_order(fcfs_llm.engine, {"first": 0, "second": 0}) == ["first", "second"]


def test_generate_hands_each_prompt_its_priority(priority_llm, monkeypatch):
    engine, seen = priority_llm.engine, []
    add_request = engine.add_request

    def recording_add_request(*args, **kwargs):
        seen.append(kwargs["priority"])
        return add_request(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", recording_add_request)
    outputs = priority_llm.generate([[1, 2], [3], [4, 5, 6]], SHORT, priority=[2, 0, 1])
    assert seen == [2, 0, 1]
    assert [len(output.outputs[0].token_ids) for output in outputs] == [2, 2, 2]
    with pytest.raises(ValueError) as error:
        priority_llm.generate([[1], [2]], SHORT, priority=[0])
    assert str(error.value) == "priority has 1 entries for 2 prompts; pass one int per prompt"


def test_generate_under_fcfs_refuses_a_priority_and_queues_nothing(fcfs_llm):
    with pytest.raises(ValueError) as error:
        fcfs_llm.generate([[1], [2]], SHORT, priority=[0, 3])
    assert str(error.value).startswith("prompt 1: request ")
    assert str(error.value).endswith(
        "has priority=3, but priority scheduling is not enabled (scheduling_policy='fcfs'); "
        "pass scheduling_policy='priority' or leave priority at 0"
    )
    assert not fcfs_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("priority", [True, 1.5, "1"])
def test_a_priority_that_is_not_an_int_is_refused(priority_llm, priority):
    with pytest.raises(ValueError, match="priority must be an int"):
        priority_llm.engine.add_request([1, 2], SHORT, priority=priority)
    assert not priority_llm.engine.has_unfinished_requests()
