"""``EngineCoreLoop.run_busy_loop``: typed commands in, one coalesced message per turn out.

Proves: each turn of the loop sends one ``EngineCoreOutputs`` carrying at most one delta per
request, and a request's deltas, in order, are exactly the offline ``LLM.generate`` greedy
tokens; a request that can never fit is refused with the engine's reason in the turn it was
added; ``AbortRequest`` ends a request with "abort" and counts it; ``Shutdown`` aborts what is still
live and ends the loop; a step that raises ends the loop with that error; the messages survive
pickling unchanged (they cross the pipe to the server). llama-tiny at level 0 on CPU.
Run: pytest tests/engine/test_core_loop.py
"""

from __future__ import annotations

import pickle

import pytest

from pieceworks.engine.core_loop import EngineCoreLoop
from pieceworks.engine.llm import LLM
from pieceworks.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineCommand,
    EngineCoreOutputs,
    Shutdown,
)
from pieceworks.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
PROMPTS = {"a": [3, 14, 15, 92], "b": [65, 35]}


@pytest.fixture(scope="module")
def llm():
    return LLM("llama-tiny", compilation_config={"level": 0}, dtype="float32", max_num_seqs=4)


def serve(core: EngineCoreLoop, script: list[list[EngineCommand]]) -> list[EngineCoreOutputs]:
    """Run the loop with ``script[i]`` as the commands of turn i (none once it runs out; a
    shutdown after 40 turns); return every message it sent."""
    sent: list[EngineCoreOutputs] = []
    turns = iter(script)

    def receive(timeout: float) -> list[EngineCommand]:
        commands = next(turns, [])
        return commands if len(sent) < 40 else [*commands, Shutdown()]

    core.run_busy_loop(receive, sent.append)
    return sent


def test_one_message_per_turn_with_every_request_and_the_offline_tokens(llm):
    offline = [out.outputs[0].token_ids for out in llm.generate([PROMPTS["a"]], GREEDY)]
    too_long = [7] * 3000  # more than llama-tiny's context: refused when added
    script = [
        [AddRequest("a", PROMPTS["a"], GREEDY), AddRequest("b", PROMPTS["b"], LONG)],
        [AddRequest("c", too_long, GREEDY)],
        *[[]] * 8,  # "a" runs to its end (async scheduling: a step's tokens come a turn later)
        [AbortRequest("b")],
        *[[]] * 4,  # idle turns: nothing to send
        [Shutdown()],
    ]
    sent = serve(EngineCoreLoop(llm.engine), script)
    assert len(sent) < len(script)  # idle turns send nothing
    steps = [message.stats.num_steps for message in sent if message.stats is not None]
    assert all(b - a in (0, 1) for a, b in zip(steps, steps[1:]))  # a message for every step
    for message in sent:
        ids = [delta.request_id for delta in message.deltas]
        assert len(ids) == len(set(ids))  # coalesced: one delta per request per turn
    deltas = [delta for message in sent for delta in message.deltas]
    by_request = {rid: [d for d in deltas if d.request_id == rid] for rid in "abc"}
    assert [t for d in by_request["a"] for t in d.new_token_ids] == offline[0]
    assert by_request["a"][-1].finish_reason == "length"
    (refusal,) = by_request["c"]
    assert refusal.error is not None and "3000" in refusal.error and refusal.finished
    assert refusal in sent[1].deltas  # in the turn it was added
    assert by_request["b"][-1].finish_reason == "abort"
    assert sent[-1].stats is not None and sent[-1].stats.num_aborted == 1
    assert sent[-1].stats.num_free_blocks == sent[-1].stats.num_blocks
    assert all(pickle.loads(pickle.dumps(message)) == message for message in sent)


def test_shutdown_aborts_what_is_live(llm):
    script = [[AddRequest("x", PROMPTS["a"], LONG)], [], [Shutdown()]]
    sent = serve(EngineCoreLoop(llm.engine), script)
    assert sent[-1].deltas[-1].request_id == "x"
    assert sent[-1].deltas[-1].finish_reason == "abort"
    assert not llm.engine.scheduler.has_unfinished_requests()


def test_a_step_that_raises_ends_the_loop_with_its_error(llm, monkeypatch):
    def broken_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.engine, "step", broken_step)
    core = EngineCoreLoop(llm.engine)
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            serve(core, [[AddRequest("y", PROMPTS["b"], GREEDY)]])
    finally:
        core.apply(AbortRequest("y"))  # the module's engine serves the next test
