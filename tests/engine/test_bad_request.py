"""A bad request fails alone: refused when it is added, or failed by itself when its step raises.

Proves: a seed outside what a ``torch.Generator`` takes, and ``logprobs`` / ``prompt_logprobs``
larger than the vocabulary, are refused with a ``ValueError`` naming the field and the limit
before anything is queued; a step that raises (the runner fails once) fails the requests of that
step, leaves no step awaiting its update, and the next ``generate`` returns the tokens a fresh
engine gives (an interrupted step too); the serving loop fails only the requests of a failed
step and keeps serving.
llama-tiny at level 0 on CPU, float32.
Run: pytest tests/engine/test_bad_request.py
"""

from __future__ import annotations

import pytest

from pieceworks.engine.core import StepFailedError
from pieceworks.engine.core_loop import EngineCoreLoop
from pieceworks.engine.llm import LLM
from pieceworks.engine.messages import AddRequest
from pieceworks.sampling_params import MAX_SEED, MIN_SEED, SamplingParams

PROMPTS = [[3, 14, 15], [92, 65]]


def greedy(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("llama-tiny", compilation_config={"level": 0}, dtype="float32", max_num_seqs=4)


@pytest.mark.parametrize("seed", [2**70, MAX_SEED + 1, MIN_SEED - 1])
def test_a_seed_out_of_range_is_refused_naming_the_range(seed):
    with pytest.raises(ValueError, match=r"seed=.*\[-2\*\*63, 2\*\*64 - 1\]"):
        SamplingParams(seed=seed)


def test_the_last_completions_seed_must_fit_too():
    SamplingParams(seed=MAX_SEED)
    SamplingParams(seed=MIN_SEED, n=3)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=MAX_SEED, n=2)  # completion 1 would use MAX_SEED + 1


def test_extreme_seeds_sample(llm):
    for seed in (MAX_SEED, MIN_SEED):
        params = SamplingParams(temperature=1.0, max_tokens=2, seed=seed, ignore_eos=True)
        assert len(llm.generate([PROMPTS[0]], params)[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_beyond_the_vocabulary_are_refused_when_added(llm, field):
    vocab_size = llm.config.model_config.hf_config["vocab_size"]
    params = SamplingParams(max_tokens=2, **{field: vocab_size + 1})
    with pytest.raises(ValueError, match=rf"{field}={vocab_size + 1}.*{vocab_size}"):
        llm.generate(PROMPTS, params)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(PROMPTS, greedy())[0].outputs[0].token_ids  # the engine still works
    ok = SamplingParams(max_tokens=1, **{field: vocab_size})  # the whole vocabulary is fine
    assert llm.generate([PROMPTS[0]], ok)[0].outputs[0].token_ids


def test_a_failed_step_fails_its_requests_and_the_next_generate_is_unaffected(llm, monkeypatch):
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(6))]
    runner = llm.engine.runner
    real_execute = runner.execute_async
    calls = {"count": 0}

    def execute_failing_on_the_third_step(output, grammar=None):
        calls["count"] += 1
        if calls["count"] == 3:
            raise RuntimeError("injected failure")
        return real_execute(output, grammar)

    monkeypatch.setattr(runner, "execute_async", execute_failing_on_the_third_step)
    with pytest.raises(StepFailedError, match="injected failure"):
        llm.generate(PROMPTS, greedy(6))
    assert not llm.engine.has_unfinished_requests()
    assert not llm.processor.has_unfinished_requests()
    outputs = llm.generate(PROMPTS, greedy(6))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    free = llm.engine.scheduler.block_manager.num_free_blocks
    assert free == llm.engine.scheduler.block_manager.num_blocks  # nothing leaked


def test_the_serving_loop_fails_only_the_failed_steps_requests(llm, monkeypatch):
    loop = EngineCoreLoop(llm.engine)
    runner = llm.engine.runner
    real_execute = runner.execute_async
    failing = {"on": True}

    def execute(output, grammar=None):
        if failing["on"]:
            failing["on"] = False
            raise RuntimeError("injected failure")
        return real_execute(output, grammar)

    monkeypatch.setattr(runner, "execute_async", execute)
    loop.apply(AddRequest("bad", [3, 14, 15], greedy(3)))
    loop.step()
    deltas = loop.take_outputs().deltas
    assert [(d.request_id, d.engine_failed) for d in deltas] == [("bad", False)]
    assert "injected failure" in (deltas[0].error or "")
    loop.apply(AddRequest("good", [3, 14, 15], greedy(3)))
    while loop.has_unfinished_requests():
        loop.step()
    good = [d for d in loop.take_outputs().deltas if d.request_id == "good"]
    assert sum(len(d.new_token_ids) for d in good) == 3
    assert good[-1].finish_reason == "length"


def test_an_interrupted_step_leaves_the_engine_clean(llm, monkeypatch):
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(6))]
    runner = llm.engine.runner
    real_execute = runner.execute_async
    calls = {"count": 0}

    def execute_interrupted_on_the_second_step(output, grammar=None):
        calls["count"] += 1
        if calls["count"] == 2:
            raise KeyboardInterrupt  # Ctrl-C while the step is being launched
        return real_execute(output, grammar)

    monkeypatch.setattr(runner, "execute_async", execute_interrupted_on_the_second_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, greedy(6))
    assert not llm.engine.has_unfinished_requests()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(6))] == expected


def test_a_failure_while_tokens_are_applied_aborts_that_step_too(llm, monkeypatch):
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(6))]
    scheduler = llm.engine.scheduler
    real_update = scheduler.update_from_output
    calls = {"count": 0}

    def update_failing_after_the_step_is_taken(output, token_ids):
        calls["count"] += 1
        if calls["count"] == 2:
            scheduler.drop_pending_outputs()  # as if it failed after taking the step
            raise RuntimeError("injected failure")
        return real_update(output, token_ids)

    monkeypatch.setattr(scheduler, "update_from_output", update_failing_after_the_step_is_taken)
    with pytest.raises(StepFailedError, match="injected failure"):
        llm.generate(PROMPTS, greedy(6))
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(6))] == expected
