"""``AsyncLLMEngine``, the asyncio front end, over a fake engine client (no engine, no model).

Proves: ``generate`` sends one ``AddRequest`` and yields its request's deltas in order; deltas that
piled up while the caller was busy come as one merged delta (tokens and log-probabilities
concatenated, the last one's finish reason, error and failure flag); a caller that leaves early
sends an ``AbortRequest``; past ``max_num_seqs + max_waiting_requests`` live requests
``reserve`` raises ``QueueFullError`` saying why; when the engine reports a failure every live
request gets an ``engine_failed`` delta with no tokens, later requests ``EngineDeadError``, and
no command is sent any more; ``stats`` follows the last message; turns that arrive together (a
front end that fell behind) reach the sinks in order and run the turn hooks once.
Run: pytest tests/engine/test_async_engine.py
"""

from __future__ import annotations

import asyncio

import pytest

from pieceworks.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError
from pieceworks.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineCommand,
    EngineCoreOutputs,
    EngineStats,
    RequestDelta,
)
from pieceworks.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=8)


class FakeClient:
    """Records commands; the test plays the engine by calling ``on_outputs``."""

    max_num_seqs = 2
    initial_stats = EngineStats(num_blocks=10, num_free_blocks=10)

    def __init__(self) -> None:
        self.commands: list[EngineCommand] = []
        self.alive = True

    def start(self, loop, on_outputs) -> None:
        self.on_outputs = on_outputs

    def send(self, command: EngineCommand) -> None:
        self.commands.append(command)

    def is_alive(self) -> bool:
        return self.alive

    def shutdown(self, timeout) -> None:
        self.alive = False


def delta(request_id: str, tokens: list[int], total: int, **fields) -> RequestDelta:
    return RequestDelta(request_id, tokens, total, **fields)


def test_deltas_in_order_and_merged_when_the_caller_fell_behind():
    async def run():
        client = FakeClient()
        engine = AsyncLLMEngine(client, max_waiting_requests=0)
        engine.start()
        stream = engine.generate([1, 2], PARAMS, "r")
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        assert client.commands == [AddRequest("r", [1, 2], PARAMS)]
        client.on_outputs([EngineCoreOutputs([delta("r", [7], 1, logprobs=["a"])], None)])
        got = [await first]
        # Three steps arrive before the caller reads again: one delta comes out.
        stats = EngineStats(num_steps=4, num_blocks=10, num_free_blocks=9)
        for step, token in enumerate([8, 9]):
            message = [delta("r", [token], step + 2, logprobs=[str(token)])]
            client.on_outputs([EngineCoreOutputs(message, None)])
        final = delta("r", [10], 4, finish_reason="length", logprobs=["10"])
        client.on_outputs([EngineCoreOutputs([final], stats)])
        got += [d async for d in stream]
        return got, engine, client

    got, engine, client = asyncio.run(run())
    assert [d.new_token_ids for d in got] == [[7], [8, 9, 10]]
    assert got[1].logprobs == ["8", "9", "10"] and got[1].finish_reason == "length"
    assert got[1].num_output_tokens == 4
    assert engine.stats.num_steps == 4 and engine.stats.kv_cache_usage == pytest.approx(0.1)
    assert engine.num_live_requests == 0
    assert len(client.commands) == 1  # finished: nothing to abort


def test_turns_that_arrive_together_run_the_turn_hooks_once():
    async def run():
        client = FakeClient()
        engine = AsyncLLMEngine(client, max_waiting_requests=0)
        hooks: list[int] = []
        engine.add_turn_hook(lambda: hooks.append(len(hooks)))
        engine.start()
        stream = engine.generate([1], PARAMS, "r")
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # the request is sent, its sink registered
        stats = EngineStats(num_steps=3, num_blocks=10, num_free_blocks=8)
        client.on_outputs(
            [
                EngineCoreOutputs([delta("r", [5], 1)], None),
                EngineCoreOutputs([delta("r", [6], 2)], stats),
                EngineCoreOutputs([delta("r", [7], 3, finish_reason="stop")], None),
            ]
        )
        got = [await first] + [d async for d in stream]
        return got, engine, hooks

    got, engine, hooks = asyncio.run(run())
    assert [(d.new_token_ids, d.finish_reason) for d in got] == [([5, 6, 7], "stop")]
    assert hooks == [0] and engine.stats.num_steps == 3


def test_a_merged_delta_ends_as_the_later_one():
    merged = delta("r", [1], 1, logprobs=["a"]).merge(
        delta("r", [2], 2, error="prompt too long", finish_reason="abort", engine_failed=True)
    )
    assert (merged.new_token_ids, merged.num_output_tokens, merged.logprobs) == ([1, 2], 2, ["a"])
    assert (merged.error, merged.finish_reason, merged.engine_failed) == (
        "prompt too long",
        "abort",
        True,
    )


def test_leaving_early_aborts_and_the_queue_is_bounded():
    async def run():
        client = FakeClient()
        engine = AsyncLLMEngine(client, max_waiting_requests=0)  # at most 2 live requests
        engine.start()
        streams = [engine.generate([1], PARAMS, f"r{i}") for i in range(2)]
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError) as full:
            engine.reserve(1)
        assert str(full.value) == (
            "2 requests are live and at most 2 are accepted (max_num_seqs running + "
            "max_waiting_requests queued); retry later"
        )
        client.on_outputs([EngineCoreOutputs([delta("r0", [5], 1), delta("r1", [6], 1)], None)])
        await asyncio.gather(*firsts)
        await streams[0].aclose()  # the caller went away
        engine.reserve(1)  # its room is free again
        return client

    client = asyncio.run(run())
    assert AbortRequest("r0") in client.commands


def test_an_engine_failure_reaches_every_live_request_and_every_later_one():
    async def run():
        client = FakeClient()
        engine = AsyncLLMEngine(client, max_waiting_requests=4)
        engine.start()
        streams = [engine.generate([1], PARAMS, f"r{i}") for i in range(2)]
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]
        await asyncio.sleep(0)
        reason = "the engine process (pid 1) was killed by signal 9; restart the server"
        client.on_outputs([EngineCoreOutputs([], None, failure=reason)])
        failed = await asyncio.gather(*firsts)
        sent = len(client.commands)
        with pytest.raises(EngineDeadError, match="signal 9"):
            engine.reserve(1)
        engine.abort("r0")
        return failed, engine, client, sent

    failed, engine, client, sent = asyncio.run(run())
    assert all(d.engine_failed and d.finished and "signal 9" in d.error for d in failed)
    assert all(d.new_token_ids == [] and d.num_output_tokens == 0 for d in failed)
    assert not engine.is_running
    assert len(client.commands) == sent  # nothing is sent to a dead engine
