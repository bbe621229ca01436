"""``LLM`` from several threads: calls serialize, two engines in one process stay independent.

Proves: one ``LLM`` called from two threads at once (``generate`` and ``stream``) gives each call
the tokens it gives alone, and the engine is idle afterwards; two ``LLM`` objects driven from two
threads at once each give their own sequential results (engine steps take turns: the forward
context, Dynamo and graph capture are process-wide).
llama-tiny at level 0 on CPU, float32.
Run: pytest tests/engine/test_llm_threads.py
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from pieceworks.engine.llm import LLM
from pieceworks.sampling_params import SamplingParams

PROMPTS_A = [[3, 14, 15], [92, 65]]
PROMPTS_B = [[35, 89, 79, 32], [7, 7, 7]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
NUM_ROUNDS = 3


def make_llm() -> LLM:
    return LLM("llama-tiny", compilation_config={"level": 0}, dtype="float32", max_num_seqs=4)


def token_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]


def streamed_token_ids(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    tokens: dict[str, list[int]] = {}
    for delta in llm.stream(prompts, PARAMS):
        tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
    return list(tokens.values())


def run_in_threads(calls: list[Callable[[], Any]]) -> list[list[Any]]:
    """Run each call NUM_ROUNDS times, all calls in threads of their own started together."""
    results: list[list[Any]] = [[] for _ in calls]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(calls))

    def worker(index: int) -> None:
        barrier.wait()
        try:
            for _ in range(NUM_ROUNDS):
                results[index].append(calls[index]())
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    return results


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def test_one_llm_from_two_threads_serializes_the_calls(llm):
    expected_a, expected_b = token_ids(llm, PROMPTS_A), token_ids(llm, PROMPTS_B)
    got_a, got_b = run_in_threads(
        [lambda: token_ids(llm, PROMPTS_A), lambda: streamed_token_ids(llm, PROMPTS_B)]
    )
    assert got_a == [expected_a] * NUM_ROUNDS
    assert got_b == [expected_b] * NUM_ROUNDS
    assert not llm.engine.has_unfinished_requests()


def test_two_llms_in_two_threads_are_independent(llm):
    other = make_llm()
    expected_a, expected_b = token_ids(llm, PROMPTS_A), token_ids(other, PROMPTS_B)
    got_a, got_b = run_in_threads(
        [lambda: token_ids(llm, PROMPTS_A), lambda: token_ids(other, PROMPTS_B)]
    )
    assert got_a == [expected_a] * NUM_ROUNDS
    assert got_b == [expected_b] * NUM_ROUNDS
