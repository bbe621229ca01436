"""``EngineCore`` and ``EngineCoreLoop`` as a caller sees them, step by step.

Proves: every decode step leaves one ``step_seconds`` entry ``(uniform decode?, number of
requests, seconds)``; ``abort_request`` and ``stop_request`` finish a request with "abort" or
"stop", free its KV blocks and say whether an unfinished request had that id; the engine's
refusals name the vocabulary and the prompt's index in full, and a shut-down engine refuses
every call with its message; ``EngineCoreLoop`` turns a ``StopRequest`` into a delta finished
with "stop", refuses a message it does not know by its repr, and its ``EngineStats`` count the
running and waiting requests, the blocks and the aborts. llama-tiny at level 0 on CPU, float32.
Run: pytest tests/engine/test_engine_core.py
"""

from __future__ import annotations

import pytest

from pieceworks.engine.core_loop import EngineCoreLoop
from pieceworks.engine.llm import LLM
from pieceworks.engine.messages import AbortRequest, AddRequest, EngineStats, StopRequest
from pieceworks.sampling_params import SamplingParams

LONG = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("llama-tiny", compilation_config={"level": 0}, dtype="float32", max_num_seqs=4)


def run_to_end(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_every_step_records_its_kind_its_requests_and_its_time(llm):
    engine = llm.engine
    run_to_end(engine)
    engine.step_seconds.clear()
    engine.add_request([3, 14, 15], SHORT)
    engine.add_request([9, 2], SHORT)
    run_to_end(engine)
    entries = engine.step_seconds
    assert entries, "no step recorded"
    for uniform, num_requests, seconds in entries:
        assert isinstance(uniform, bool)
        assert num_requests == 2
        assert 0.0 < seconds < 60.0
    assert entries[0][0] is False  # the prefill
    assert any(uniform for uniform, _, _ in entries)  # the decode steps


def test_abort_and_stop_finish_a_request_and_free_its_blocks(llm):
    engine = llm.engine
    run_to_end(engine)
    blocks = engine.scheduler.block_manager
    free = blocks.num_free_blocks
    aborted = engine.add_request([1, 2, 3], LONG)
    stopped = engine.add_request([4, 5, 6], LONG)
    engine.step()
    engine.step()
    assert blocks.num_free_blocks < free
    assert engine.abort_request(aborted.request_id) is True
    assert aborted.finish_reason == "abort" and aborted.is_finished
    assert engine.abort_request(aborted.request_id) is False  # already finished
    assert engine.stop_request(stopped.request_id) is True
    assert stopped.finish_reason == "stop" and stopped.is_finished
    assert engine.stop_request(stopped.request_id) is False
    assert engine.abort_request("no such id") is False
    assert engine.stop_request("no such id") is False
    run_to_end(engine)
    assert not engine.has_unfinished_requests()
    assert blocks.num_free_blocks == free
    assert len(aborted.output_token_ids) < 50 and len(stopped.output_token_ids) < 50


def test_refusals_name_the_vocabulary_and_the_prompt(llm):
    engine = llm.engine
    run_to_end(engine)
    with pytest.raises(ValueError) as error:
        engine.add_request([1, 256], SHORT)
    assert str(error.value) == "prompt token ids must be in [0, 256) for this model"
    with pytest.raises(ValueError) as error:
        engine.add_requests([[1], [2], [-1]], [SHORT] * 3)
    assert str(error.value) == "prompt token ids must be in [0, 256) for this model"
    with pytest.raises(ValueError) as error:
        engine.add_requests([[1], [7] * 3000], [SHORT] * 2)
    assert str(error.value).startswith("prompt 1: ")
    assert not engine.has_unfinished_requests()  # nothing queued
    checked = engine.check_requests([[1, 2], [3]], [SHORT, LONG])
    assert [r.prompt_token_ids for r in checked] == [[1, 2], [3]]
    assert [r.sampling_params for r in checked] == [SHORT, LONG]
    assert not engine.has_unfinished_requests()
    named = engine.add_request([5], SHORT, request_id="mine")
    assert named.request_id == "mine"
    assert named.eos_token_id == engine.eos_token_id
    run_to_end(engine)
    assert named.output_token_ids and named.finish_reason == "length"


def test_core_stop_command_and_stats(llm):
    engine = llm.engine
    run_to_end(engine)
    core = EngineCoreLoop(engine)
    assert core.stats() == EngineStats(
        num_running=0,
        num_waiting=0,
        num_blocks=engine.scheduler.block_manager.num_blocks,
        num_free_blocks=engine.scheduler.block_manager.num_blocks,
        num_steps=0,
        num_aborted=0,
        # Cumulative over the engine's life (the module's engine has served earlier tests).
        prefix_cache_queries=engine.scheduler.block_manager.num_prefix_cache_queries,
        prefix_cache_hits=engine.scheduler.block_manager.num_prefix_cache_hits,
        request_queue_time=engine.scheduler.timing.queue.snapshot(),
        request_prefill_time=engine.scheduler.timing.prefill.snapshot(),
    )
    queued = core.stats().request_queue_time.count
    core.apply(AddRequest("s", [1, 2, 3], LONG))
    core.apply(AddRequest("a", [4, 5], LONG))
    assert core.stats().num_waiting == 2
    core.step()
    core.step()
    stats = core.stats()
    assert stats.num_running == 2 and stats.num_waiting == 0 and stats.num_steps == 2
    assert stats.request_queue_time.count == queued + 2  # both scheduled: their queue times
    assert stats.num_free_blocks < stats.num_blocks
    assert 0.0 < stats.kv_cache_usage <= 1.0
    core.take_outputs()
    core.apply(StopRequest("s"))
    core.apply(AbortRequest("a"))
    core.apply(StopRequest("gone"))  # an unknown id: a no-op
    outputs = core.take_outputs()
    finished = {delta.request_id: delta.finish_reason for delta in outputs.deltas}
    assert finished == {"s": "stop", "a": "abort"}
    assert outputs.stats.num_aborted == 1  # a stop is not an abort
    assert outputs.stats.num_running == 0
    with pytest.raises(ValueError) as error:
        core.apply("bogus")  # type: ignore[arg-type]
    assert str(error.value) == "unknown engine command 'bogus'"
    run_to_end(engine)
    assert EngineStats().kv_cache_usage == 0.0
    assert EngineStats(num_blocks=4, num_free_blocks=1).kv_cache_usage == 0.75


def test_a_shut_down_engine_refuses_every_call():
    llm = LLM("llama-tiny", compilation_config={"level": 0}, dtype="float32", max_model_len=64)
    engine = llm.engine
    assert engine.is_shut_down is False
    engine.shutdown()
    assert engine.is_shut_down is True
    message = "this engine was shut down (its graphs and workers are freed); build a new LLM"
    for call in (
        lambda: engine.add_request([1], SHORT),
        lambda: engine.add_requests([[1]], [SHORT]),
        lambda: engine.abort_request("0"),
        lambda: engine.stop_request("0"),
        engine.step,
    ):
        with pytest.raises(RuntimeError) as error:
            call()
        assert str(error.value) == message
