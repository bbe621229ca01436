"""Multi-step decode through the engine changes no token a caller sees.

The mixed workload of ``tests/engine/test_host_path.py`` (arrivals over time, more requests than
seats, a small KV cache, a stop token and a stop string, an abort mid-run, ``max_tokens`` of 12,
20, 16, 10, 8 and 1, none a multiple of 4, greedy and seeded sampling) runs through
``OutputProcessor`` streaming with ``num_scheduler_steps`` 1 (the path without multi-step) and 4,
with async scheduling on and off, in eager mode and with FULL and PIECEWISE graphs (on simgraph,
whose replay reads the captured buffers, so an input the device did not advance would show).
Proved, per request: the same tokens, token for token, the same text and finish reason (the
aborted request: one token list a prefix of the other); no stream gets a delta after its finish;
runs of 4 steps did happen; nothing leaked. A request alone, whose stop token or stop string
comes inside a run, ends there with the single-step tokens and text, the run's later tokens
dropped. Requests that cannot all hold their KV are preempted with multi-step on and keep their
tokens. ``AsyncLLMEngine`` streams the same tokens per request, in order, with K = 4 as with 1.

Run: ``PIECEWORKS_PLATFORM=cpu pytest tests/engine/test_multi_step_engine.py -q``
"""

from __future__ import annotations

import asyncio

import pytest

from pieceworks.engine.async_engine import AsyncLLMEngine
from pieceworks.engine.core_client import InprocEngineClient
from pieceworks.engine.llm import LLM
from pieceworks.engine.output_processor import OutputProcessor
from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.output import SchedulerOutput
from tests.engine.test_host_path import (
    ABORTED,
    NUM_BLOCKS,
    CharTokenizer,
    results,
    run,
    save_scaled_llama_tiny,
    stops_from_a_first_run,
    workload,
)
from tests.engine.test_host_path import make_llm as host_path_llm

NUM_STEPS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_scaled_llama_tiny(tmp_path_factory.mktemp("llama-tiny"))


def make_llm(checkpoint: str, mode: str, num_scheduler_steps: int, async_scheduling: bool) -> LLM:
    return host_path_llm(checkpoint, mode, async_scheduling, num_scheduler_steps)


def recorded_run(llm: LLM, arrivals: dict) -> tuple[list, list[SchedulerOutput]]:
    """``run``'s deltas, and every output the scheduler launched."""
    schedule, outputs = llm.engine.scheduler.schedule, []
    llm.engine.scheduler.schedule = lambda: outputs.append(schedule()) or outputs[-1]
    steps = run(llm, arrivals, lambda: None)
    return steps, [output for output in outputs if output.scheduled_requests]


def tokens_sampled(outputs: list[SchedulerOutput], request_id: str) -> int:
    return sum(
        output.num_steps
        for output in outputs
        for item in output.producing_requests
        if item.request.request_id == request_id
    )


def check_streams(steps: list) -> None:
    """No request gets a delta after the one that finished it."""
    finished: set[str] = set()
    for deltas in steps:
        for request_id, _, _, reason in deltas:
            assert request_id not in finished, f"{request_id}: a delta after its finish"
            if reason is not None:
                finished.add(request_id)


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("mode", ["eager", "full_and_piecewise"])
def test_multi_step_gives_the_single_step_tokens(
    checkpoint, graph_platform, mode, async_scheduling
):
    single_llm = make_llm(checkpoint, mode, 1, async_scheduling)
    arrivals = workload(*stops_from_a_first_run(single_llm))
    single_steps, single_outputs = recorded_run(single_llm, arrivals)
    single_llm.shutdown()
    assert all(output.num_steps == 1 for output in single_outputs)
    assert sum(len(output.preempted_requests) for output in single_outputs) > 0

    llm = make_llm(checkpoint, mode, NUM_STEPS, async_scheduling)
    steps, outputs = recorded_run(llm, arrivals)
    llm.shutdown()
    check_streams(steps)
    assert any(output.num_steps == NUM_STEPS for output in outputs)

    single, multi = results(single_steps), results(steps)
    assert {r: v for r, v in multi.items() if r != ABORTED} == {
        r: v for r, v in single.items() if r != ABORTED
    }
    aborted, single_aborted = multi[ABORTED][0], single[ABORTED][0]
    shorter = min(len(aborted), len(single_aborted))
    assert aborted[:shorter] == single_aborted[:shorter] and shorter > 0
    assert multi["b"][2] == "stop" and multi["c"][2] == "stop"
    assert [len(multi[rid][0]) for rid in "adg"] == [12, 20, 1]


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_preemption_between_runs_keeps_the_tokens(checkpoint, async_scheduling):
    """Three requests of up to 39 KV tokens (3 blocks of 16 each) in 4 blocks: they cannot all
    run; runs go single-step when their blocks are short, and the newest is preempted."""
    arrivals = {
        0: [
            ("p", [7] * 20, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)),
            (
                "q",
                [3, 1] * 9,
                SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=6),
            ),  # fmt: skip
        ],
        1: [("s", [5] * 12, SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True))],
    }

    def tokens(num_scheduler_steps: int) -> tuple[dict, list[SchedulerOutput]]:
        llm = make_llm(checkpoint, "eager", num_scheduler_steps, async_scheduling)
        schedule, outputs = llm.engine.scheduler.schedule, []
        llm.engine.scheduler.schedule = lambda: outputs.append(schedule()) or outputs[-1]
        processor, steps, call = OutputProcessor(llm.engine, CharTokenizer()), [], 0
        while call <= max(arrivals) or processor.has_unfinished_requests():
            for request_id, prompt, params in arrivals.get(call, []):
                processor.add_request(prompt, params, request_id=request_id)
            steps.append([(d.request_id, tuple(d.token_ids), d.text, d.finish_reason)
                          for d in processor.step()])  # fmt: skip
            call += 1
        assert llm.engine.scheduler.block_manager.num_free_blocks == NUM_BLOCKS
        llm.shutdown()
        return results(steps), outputs

    single, _ = tokens(1)
    multi, outputs = tokens(NUM_STEPS)
    assert multi == single
    assert sum(len(output.preempted_requests) for output in outputs) > 0
    assert any(output.num_steps == NUM_STEPS for output in outputs)


def run_alone(llm: LLM, prompt: list[int], params: SamplingParams) -> list:
    """Every step's deltas of one request alone in the engine, as ``run`` gives them."""
    processor = OutputProcessor(llm.engine, CharTokenizer())
    processor.add_request(prompt, params, request_id="r")
    steps = []
    while processor.has_unfinished_requests():
        deltas = processor.step()
        steps.append([(d.request_id, tuple(d.token_ids), d.text, d.finish_reason) for d in deltas])
    return steps


def first_new_token_at_or_after(tokens: list[int], index: int) -> int:
    """The first position >= index whose token does not occur before it."""
    while tokens[index] in tokens[:index]:
        index += 1
    return index


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("stop_kind", ["token", "string"])
def test_a_stop_inside_a_run_ends_the_request_there(checkpoint, stop_kind, async_scheduling):
    """Alone in the engine, a request runs its prefill (token 1) and then runs of 4 steps
    (tokens 2-5, 6-9, ...): a stop at token 7 or later, not a multiple of 4 plus 1, is inside
    a run. Its tokens and text are those of single steps; the run's later tokens are dropped."""
    prompt = [17, 99, 3, 250, 41, 8]
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = make_llm(checkpoint, "eager", 1, async_scheduling)
    free_tokens = results(run_alone(llm, prompt, free))["r"][0]
    index = first_new_token_at_or_after(free_tokens, 6)
    if index % NUM_STEPS == 0:  # the last token of a run: take the next new one
        index = first_new_token_at_or_after(free_tokens, index + 1)
    if stop_kind == "token":
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                stop_token_ids=[free_tokens[index]])  # fmt: skip
    else:
        text = CharTokenizer().decode(free_tokens)
        stop = text[index - 1 : index + 1]
        assert text.find(stop) == index - 1  # its first match ends at token ``index``
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    single = results(run_alone(llm, prompt, params))["r"]
    llm.shutdown()
    llm = make_llm(checkpoint, "eager", NUM_STEPS, async_scheduling)
    schedule, outputs = llm.engine.scheduler.schedule, []
    llm.engine.scheduler.schedule = lambda: outputs.append(schedule()) or outputs[-1]
    steps = run_alone(llm, prompt, params)
    outputs = [output for output in outputs if output.scheduled_requests]
    llm.shutdown()
    multi = results(steps)["r"]
    assert multi == single and multi[2] == "stop"
    assert multi[0] == free_tokens[: index + 1]
    assert [output.num_steps for output in outputs[:3]] == [1, NUM_STEPS, NUM_STEPS]
    assert tokens_sampled(outputs, "r") > index + 1  # sampled past the stop, never emitted


@pytest.mark.platform_agnostic
def test_async_engine_streams_the_same_tokens_in_order(checkpoint):
    prompts = [[5, 9, 2, 7], [1, 2, 3], [8] * 11, [4, 4]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True, seed=4),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.7, max_tokens=17, ignore_eos=True, seed=8),
    ]

    def stream_all(num_scheduler_steps: int) -> list[list[list[int]]]:
        llm = make_llm(checkpoint, "eager", num_scheduler_steps, async_scheduling=True)
        engine = AsyncLLMEngine(InprocEngineClient(llm.engine))

        async def one(index: int) -> list[list[int]]:
            await asyncio.sleep(0.01 * index)  # arrivals while others decode
            chunks = []
            async for delta in engine.generate(prompts[index], params[index], f"r{index}"):
                assert delta.error is None
                chunks.append(delta.new_token_ids)
                assert delta.num_output_tokens == sum(len(chunk) for chunk in chunks)
            assert delta.finish_reason == "length"
            return chunks

        async def main() -> list[list[list[int]]]:
            engine.start()  # the engine loop's outputs go to this event loop
            return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

        try:
            return asyncio.run(main())
        finally:
            engine.shutdown()

    single, multi = stream_all(1), stream_all(NUM_STEPS)
    for single_chunks, multi_chunks, param in zip(single, multi, params):
        tokens = [token for chunk in multi_chunks for token in chunk]
        assert tokens == [token for chunk in single_chunks for token in chunk]
        assert len(tokens) == param.max_tokens
        # a run's tokens come together (more than one run's when the reader fell behind and the
        # front end merged the deltas), so fewer chunks than tokens
        assert len(multi_chunks) < len(tokens)
