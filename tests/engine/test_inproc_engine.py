"""``AsyncLLMEngine`` over ``InprocEngineClient``: the engine loop on a thread of this process.

Proves: before the first step the stats are the engine's (every block free); a request streams
the offline greedy tokens and ends with "length"; ``stop`` ends a running request with "stop";
the stats follow the engine; the turns that arrive while the event loop is busy reach the
front end in one call, in order; a step that raises reaches the live request as an
``engine_failed`` delta whose error names the exception, and later requests get
``EngineDeadError``; after ``shutdown`` the loop thread is gone, the engine is shut down and
``reserve`` refuses with its message; a negative ``max_waiting_requests`` is refused with its
message. llama-tiny at level 0 on CPU, float32.
Run: pytest tests/engine/test_inproc_engine.py
"""

from __future__ import annotations

import asyncio
import time

import pytest

from pieceworks.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from pieceworks.engine.core_client import InprocEngineClient
from pieceworks.engine.llm import LLM
from pieceworks.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
PROMPT = [3, 14, 15, 92]


def make_llm() -> LLM:
    return LLM("llama-tiny", compilation_config={"level": 0}, dtype="float32", max_num_seqs=2)


async def collect(engine: AsyncLLMEngine, prompt, params, request_id=None):
    return [delta async for delta in engine.generate(prompt, params, request_id)]


def test_requests_stream_stop_and_shut_down_through_the_thread():
    llm = make_llm()
    offline = llm.generate([PROMPT], GREEDY)[0].outputs[0].token_ids
    client = InprocEngineClient(llm.engine)
    num_blocks = llm.engine.scheduler.block_manager.num_blocks
    assert client.max_num_seqs == 2
    assert client.initial_stats.num_blocks == num_blocks
    assert client.initial_stats.num_free_blocks == num_blocks
    assert client.is_alive() is False  # not started
    engine = AsyncLLMEngine(client, max_waiting_requests=1)
    assert engine.stats is client.initial_stats
    assert engine.max_live_requests == 3 and engine.is_running is False

    async def main():
        engine.start()
        assert engine.is_running and client.is_alive()
        deltas = await collect(engine, PROMPT, GREEDY, "a")
        assert [t for d in deltas for t in d.new_token_ids] == offline
        assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 5
        stream = engine.generate(PROMPT, LONG, "long")
        first = await stream.__anext__()
        assert first.new_token_ids and first.finish_reason is None
        engine.stop("long")
        rest = [delta async for delta in stream]
        assert rest[-1].finish_reason == "stop"
        assert rest[-1].num_output_tokens < 1000
        await asyncio.sleep(0.05)
        assert engine.stats.num_steps > 0 and engine.stats.num_running == 0
        assert engine.num_live_requests == 0

    asyncio.run(main())
    engine.shutdown(timeout=10)
    assert client.is_alive() is False and llm.engine.is_shut_down
    with pytest.raises(QueueFullError) as error:
        engine.reserve(1)
    assert str(error.value) == "the server is shutting down and accepts no new requests"
    with pytest.raises(ValueError) as error:
        AsyncLLMEngine(client, max_waiting_requests=-1)
    assert str(error.value) == "max_waiting_requests=-1 must be >= 0"


def test_turns_that_arrive_while_the_loop_is_busy_are_dispatched_together():
    llm = make_llm()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    offline = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    engine = AsyncLLMEngine(InprocEngineClient(llm.engine))
    turns_per_call = []
    dispatch = engine._dispatch

    def recording(turns):
        turns_per_call.append(len(turns))
        dispatch(turns)

    engine._dispatch = recording  # type: ignore[method-assign]

    async def main():
        engine.start()
        stream = engine.generate(PROMPT, params, "a")
        first = await stream.__anext__()
        time.sleep(0.5)  # the event loop is busy while the engine thread steps on
        rest = [delta async for delta in stream]
        return [t for delta in [first, *rest] for t in delta.new_token_ids]

    assert asyncio.run(main()) == offline
    engine.shutdown(timeout=10)
    assert max(turns_per_call) > 1, turns_per_call


def test_a_step_that_raises_fails_the_live_request_and_every_later_one(monkeypatch):
    llm = make_llm()
    client = InprocEngineClient(llm.engine)

    def broken_step() -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(client.core_loop, "step", broken_step)
    engine = AsyncLLMEngine(client)

    async def main():
        engine.start()
        deltas = await collect(engine, PROMPT, GREEDY)
        assert len(deltas) == 1
        (failed,) = deltas
        assert failed.engine_failed is True and failed.new_token_ids == []
        assert failed.error == "the engine failed: RuntimeError('boom')"
        assert engine.error == failed.error and engine.is_running is False
        with pytest.raises(EngineDeadError) as error:
            engine.reserve(1)
        assert str(error.value) == "the engine failed: RuntimeError('boom')"

    asyncio.run(main())
    engine.shutdown(timeout=10)
