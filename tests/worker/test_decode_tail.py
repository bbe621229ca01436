"""Captured decode tails change no token a caller sees, step for step.

A decode step whose batch fills a capture size, all of it greedy, samples inside one captured
graph per step (``worker/decode_tail.py``): the LM head, the argmax and the advance to the next
step of a multi-step run. A greedy workload with arrivals over time, more requests than seats, a
small KV cache (preemption), a stop token, a stop string, an abort mid-run and varied
``max_tokens`` streams through ``OutputProcessor`` with the tails and with them switched off (the
launches they replace), one and four decode steps per host round trip, async scheduling on and
off, with FULL and PIECEWISE graphs on simgraph (whose replay re-runs the tail on the buffers it
captured, so a tail reading or writing the wrong rows would show). Proved: the same deltas in
the same steps (token ids, text, finish reasons); tails ran, in runs of one step and of four;
a step with a random row, a log-probability request or a ``logit_bias`` takes the launches
instead (the biased row's tokens are the forced ones).

Run: ``PIECEWORKS_PLATFORM=cpu pytest tests/worker/test_decode_tail.py -q``
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pieceworks.core.counters import compilation_counter
from pieceworks.engine.llm import LLM
from pieceworks.sampling_params import SamplingParams
from tests.engine.test_host_path import (
    ABORTED,
    make_llm,
    results,
    run,
    save_scaled_llama_tiny,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_scaled_llama_tiny(tmp_path_factory.mktemp("llama-tiny"))


def greedy_workload(stop_string: str | None, stop_token: int | None) -> dict[int, list[tuple]]:
    """Step -> the requests (id, prompt, params) that arrive before it; every one greedy."""
    generator = torch.Generator().manual_seed(13)

    def prompt(length: int) -> list[int]:
        return torch.randint(0, 256, (length,), generator=generator).tolist()

    def greedy(max_tokens: int, **fields: Any) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields)

    stop = [stop_string] if stop_string else []
    stop_token_ids = [stop_token] if stop_token is not None else []
    return {
        0: [
            ("a", prompt(14), greedy(12)),
            (ABORTED, prompt(6), greedy(20)),
            ("b", prompt(9), greedy(16, stop=stop)),
            ("h", prompt(5), greedy(11)),
        ],
        2: [("c", prompt(3), greedy(10, stop_token_ids=stop_token_ids))],
        3: [("d", prompt(20), greedy(20))],
        5: [("f", prompt(7), greedy(8)), ("g", prompt(4), greedy(1))],
    }


def tail_runs(llm: LLM) -> list[int]:
    """Spy on the runner: the number of steps of every run its decode tails sampled."""
    runner, steps = llm.engine.runner, []
    run_tails = runner._run_decode_tails

    def spy(step, num_steps: int, grammar=None):
        steps.append(num_steps)
        return run_tails(step, num_steps, grammar)

    runner._run_decode_tails = spy
    return steps


def stops(llm: LLM) -> tuple[str, int]:
    """A stop string from the middle of b's text, a stop token from the middle of c's."""
    first = results(run(llm, greedy_workload(None, None), lambda: None))
    return first["b"][1][4:6], first["c"][0][4]


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
@pytest.mark.parametrize("mode", ["full", "full_and_piecewise"])
def test_decode_tails_give_the_launches_tokens_step_for_step(
    checkpoint, graph_platform, mode, num_scheduler_steps, async_scheduling
):
    without = make_llm(checkpoint, mode, async_scheduling, num_scheduler_steps)
    without.engine.runner.graphs.decode_tail_descriptors = set()  # every step samples by launches
    arrivals = greedy_workload(*stops(without))
    reference = run(without, arrivals, lambda: None)
    without.shutdown()

    llm = make_llm(checkpoint, mode, async_scheduling, num_scheduler_steps)
    sizes = {d.num_tokens for d in llm.engine.runner.graphs.decode_tail_descriptors}
    assert sizes == {1, 2, 4}  # the FULL graphs of at most 4 tokens (the seats)
    runs = tail_runs(llm)
    with compilation_counter.expect(num_decode_tails_captured=0, num_cudagraph_captured=0):
        steps = run(llm, arrivals, lambda: None)
    llm.shutdown()
    assert steps == reference
    assert runs and (num_scheduler_steps == 1 or num_scheduler_steps in runs)
    final = results(steps)
    assert final["b"][2] == "stop" and len(final["b"][0]) < 16  # the stop string
    assert final["c"][2] == "stop" and len(final["c"][0]) < 10  # the stop token
    assert final[ABORTED][2] is None and 0 < len(final[ABORTED][0]) < 20
    assert [len(final[rid][0]) for rid in "adgh"] == [12, 20, 1, 11]


@pytest.mark.platform_agnostic
@pytest.mark.parametrize(
    "odd_one",
    [
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, logprobs=2, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, logit_bias={7: 100}, max_tokens=6, ignore_eos=True),
    ],
    ids=["random row", "logprobs", "logit_bias"],
)
def test_a_batch_with_a_random_or_logprobs_row_takes_the_launches(
    checkpoint, graph_platform, odd_one
):
    llm = make_llm(checkpoint, "full_and_piecewise", num_scheduler_steps=4)
    runs = tail_runs(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9], [3, 3]], [greedy] * 3 + [odd_one])
    assert runs == []
    assert all(len(out.outputs[0].token_ids) == 6 for out in outputs)
    if odd_one.logit_bias:
        assert outputs[3].outputs[0].token_ids == [7] * 6
    only_greedy = llm.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9], [3, 3]], greedy)
    assert runs  # the same batch, all greedy, samples in the tails
    assert [o.outputs[0].token_ids for o in only_greedy[:3]] == [
        o.outputs[0].token_ids for o in outputs[:3]
    ]
    llm.shutdown()
