"""The engine loop's typed messages cross a process pipe unchanged (no engine, no model).

Proves: every command (``AddRequest``, ``AbortRequest``, ``StopRequest``, ``Shutdown``) and an
``EngineCoreOutputs`` with its deltas and stats survive both picklers the pipes use (the
commands' ``ForkingPickler``, the outputs' plain ``pickle``) equal to what was sent, and a
``RequestDelta`` pickles as its constructor arguments, not as a state dict.
Run: pytest tests/engine/test_messages.py
"""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

from pieceworks.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineCoreOutputs,
    EngineStats,
    RequestDelta,
    Shutdown,
    StopRequest,
)
from pieceworks.sampling_params import SamplingParams


def test_commands_and_outputs_survive_pickling():
    commands = [
        AddRequest("a", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4)),
        AddRequest("p", [4], SamplingParams(), priority=-2),  # the priority travels too
        AbortRequest("a"),
        StopRequest("b"),
        Shutdown(),
    ]
    assert pickle.loads(bytes(ForkingPickler.dumps(commands))) == commands
    delta = RequestDelta("a", [7, 8], 2, "length", logprobs=[{7: -0.5}, {8: -0.25}])
    outputs = EngineCoreOutputs([delta], EngineStats(1, 0, 8, 6, 3, 0))
    assert pickle.loads(pickle.dumps(outputs, pickle.HIGHEST_PROTOCOL)) == outputs


def test_a_delta_pickles_as_its_constructor_arguments():
    delta = RequestDelta("a", [7], 1, error="refused", engine_failed=True)
    constructor, args = delta.__reduce__()
    assert constructor is RequestDelta and constructor(*args) == delta
