"""``ModelRunner.plan`` when FULL graphs are captured: the padded layout and the graph of a step.

Proves: with FULL_AND_PIECEWISE a uniform decode batch is padded to the next capture size and
replays the FULL decode graph in its captured layout (one token per padded sequence) holding
the real token and sequence counts, and a mixed batch is padded and runs PIECEWISE with its own
layout; with FULL a decode batch replays the FULL decode graph too and every other batch the
general FULL graph in its captured layout (up to ``max_num_seqs`` sequences, the query bound the
capture size); with FULL_DECODE_ONLY a mixed
batch runs without graphs, unpadded; a batch past the largest capture size runs without graphs
in every mode; the decode steps of a real generation take the FULL plan and run their forward
under it; level 0 says at INFO that its piece graphs are captured breakable.
llama-tiny at level 0 (breakable graphs for PIECEWISE) on the simgraph example platform,
capture sizes 1, 2, 4, 8, max_num_seqs 4.
Run: pytest tests/worker/test_full_graph_plans.py
"""

from __future__ import annotations

import pytest

from pieceworks import platforms
from pieceworks.core.config import CUDAGraphMode
from pieceworks.core.forward_context import BatchDescriptor
from pieceworks.engine.llm import LLM
from pieceworks.sampling_params import SamplingParams
from pieceworks.worker.input_buffers import StepShape

FULL, PIECEWISE, NONE = CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE


@pytest.fixture(scope="module")
def llm_for():
    """A llama-tiny ``LLM`` in a cudagraph mode, built once per mode."""
    simgraph = pytest.importorskip(
        "pieceworks_simgraph.platform", reason="pip install -e examples/pieceworks-simgraph"
    )
    built: dict[str, LLM] = {}

    def llm(mode: str) -> LLM:
        if mode not in built:
            sizes = [1, 2, 4, 8]
            compilation = {"level": 0, "cudagraph_mode": mode, "cudagraph_capture_sizes": sizes}
            built[mode] = LLM("llama-tiny", compilation_config=compilation, dtype="float32",
                              max_num_seqs=4)  # fmt: skip
        return built[mode]

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(platforms, "_current", simgraph.SimGraphPlatform())
        yield llm
        for built_llm in built.values():
            built_llm.shutdown()


def test_full_and_piecewise_decodes_replay_full_graphs_and_mixed_batches_pieces(llm_for):
    runner = llm_for("FULL_AND_PIECEWISE").engine.runner
    # (num_tokens, num_seqs, max_query_len, uniform decode)
    assert runner._plan(3, 3, 1, True) == (StepShape(3, 4, 3, 4, 1), FULL, BatchDescriptor(4, True))
    assert runner._plan(1, 1, 1, True) == (StepShape(1, 1, 1, 1, 1), FULL, BatchDescriptor(1, True))
    assert runner._plan(3, 2, 2, False) == (StepShape(3, 4, 2, 2, 2), PIECEWISE, BatchDescriptor(4))
    assert runner._plan(6, 4, 3, False) == (StepShape(6, 8, 4, 4, 3), PIECEWISE, BatchDescriptor(8))
    assert runner._plan(8, 4, 5, False) == (StepShape(8, 8, 4, 4, 5), PIECEWISE, BatchDescriptor(8))
    assert runner._plan(9, 2, 5, False) == (StepShape(9, 9, 2, 2, 5), NONE, None)


def test_full_replays_the_general_graph_in_its_captured_layout(llm_for):
    runner = llm_for("FULL").engine.runner
    # decodes replay the decode graph, as in FULL_AND_PIECEWISE (one token per padded sequence)
    assert runner._plan(3, 3, 1, True) == (StepShape(3, 4, 3, 4, 1), FULL, BatchDescriptor(4, True))
    # the rest: captured as min(size, max_num_seqs) sequences, the capture size as query bound
    assert runner._plan(3, 2, 2, False) == (StepShape(3, 4, 2, 4, 4), FULL, BatchDescriptor(4))
    assert runner._plan(5, 2, 4, False) == (StepShape(5, 8, 2, 4, 8), FULL, BatchDescriptor(8))
    assert runner._plan(2, 1, 2, False) == (StepShape(2, 2, 1, 2, 2), FULL, BatchDescriptor(2))
    assert runner._plan(9, 3, 5, False) == (StepShape(9, 9, 3, 3, 5), NONE, None)


def test_full_decode_only_runs_mixed_batches_unpadded(llm_for):
    runner = llm_for("FULL_DECODE_ONLY").engine.runner
    assert runner._plan(3, 3, 1, True) == (StepShape(3, 4, 3, 4, 1), FULL, BatchDescriptor(4, True))
    assert runner._plan(4, 4, 1, True) == (StepShape(4, 4, 4, 4, 1), FULL, BatchDescriptor(4, True))
    assert runner._plan(3, 2, 2, False) == (StepShape(3, 3, 2, 2, 2), NONE, None)


def test_the_decode_steps_of_a_generation_take_the_full_plan(llm_for, monkeypatch):
    from pieceworks.worker import model_runner

    llm = llm_for("FULL_AND_PIECEWISE")
    runner = llm.engine.runner
    runner._plans.clear()
    contexts = []  # (graph mode, descriptor) each forward ran under
    set_forward_context = model_runner.set_forward_context

    def recording(*args, **kwargs):
        contexts.append((kwargs.get("cudagraph_runtime_mode"), kwargs.get("batch_descriptor")))
        return set_forward_context(*args, **kwargs)

    monkeypatch.setattr(model_runner, "set_forward_context", recording)
    prompts = [[3, 14, 15], [92, 65], [35, 89, 79, 32]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3, 3]
    # the prefill without graphs, then both decode steps replaying the FULL graph of size 4
    assert contexts == [(NONE, None), *[(FULL, BatchDescriptor(4, True))] * 2]
    # one prefill of 3 + 2 + 4 tokens (past the largest capture size), then decodes of 3
    assert set(runner._plans) == {(9, 3, 4, False), (3, 3, 1, True)}
    assert runner._plans[(3, 3, 1, True)] == (
        StepShape(3, 4, 3, 4, 1),
        FULL,
        BatchDescriptor(4, True),
    )


def test_level_0_says_its_piece_graphs_are_captured_breakable(monkeypatch, caplog):
    import logging

    simgraph = pytest.importorskip("pieceworks_simgraph.platform")
    monkeypatch.setattr(platforms, "_current", simgraph.SimGraphPlatform())
    monkeypatch.setattr(logging.getLogger("pieceworks"), "propagate", True)
    caplog.set_level(logging.INFO, logger="pieceworks.worker.graph_capture")
    compilation = {"level": 0, "cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2]}
    LLM("llama-tiny", compilation_config=compilation, dtype="float32", max_num_seqs=2).shutdown()
    said = {
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name == "pieceworks.worker.graph_capture" and "breakable" in r.getMessage()
    }
    assert said == {(logging.INFO, "level 0: PIECEWISE graphs captured breakable (no compile)")}
