"""Speculative decoding through the engine changes no greedy token a caller sees.

A random model's greedy text rarely repeats, so the n-gram proposer would seldom be right. The
main test therefore swaps in an oracle proposer that proposes each request's next tokens from a
run without speculation (right for some requests, wrong at a rotating position for others,
nothing for one), so accepted runs of every length, mismatches and bonus tokens all happen. A
mixed workload (arrivals over time, a small KV cache, a stop token and a stop string inside
accepted runs, an abort, ``max_tokens`` of 1) runs through ``OutputProcessor`` streaming with
and without ``speculative_config`` (k = 3), in eager mode and with PIECEWISE, FULL_AND_PIECEWISE
and breakable (level 0) graphs on simgraph. Proved, per request: the same tokens, text and
finish reason (the aborted request: one a prefix of the other); no delta after a finish;
proposals were accepted and rejected; nothing leaked; with FULL graphs, uniform verify batches
replayed the FULL graph captured for 4 query tokens per sequence. Requests preempted while
others verify resume with the same tokens. The real n-gram proposer on llama-tiny at its preset
scale (whose greedy text repeats one token) accepts nearly every proposal and gives the same
tokens as decoding without it; logprobs of accepted tokens equal those without speculation; a
seeded sampled request gives the same tokens twice; with async scheduling, the verified tokens
are the same and requests that get no proposals back off, so most steps need no host sync;
``AsyncLLMEngine`` streams the same tokens,
several per delta, and its stats carry the acceptance totals; a request with ``logit_bias``
verifies under its bias and structured-output requests beside verified ones keep their grammar.

Run: ``PIECEWORKS_PLATFORM=cpu pytest tests/engine/test_spec_decode_engine.py -q``
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

import pytest

from pieceworks.core.config import CUDAGraphMode
from pieceworks.engine.async_engine import AsyncLLMEngine
from pieceworks.engine.core_client import InprocEngineClient
from pieceworks.engine.llm import LLM
from pieceworks.engine.output_processor import OutputProcessor
from pieceworks.sampling_params import SamplingParams
from pieceworks.speculative_config import SpeculativeConfig
from pieceworks.worker.spec_decode.proposer import Proposer
from tests.engine.test_host_path import (
    NUM_BLOCKS,
    CharTokenizer,
    compilation_for_mode,
    results,
    save_scaled_llama_tiny,
)
from tests.engine.test_multi_step_engine import check_streams

K = 3
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3}
ABORTED, ABORT_STEP = "e", 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_scaled_llama_tiny(tmp_path_factory.mktemp("llama-tiny"))


def make_llm(
    model: str,
    mode: str,
    speculative: bool,
    num_blocks: int | None = NUM_BLOCKS,
    async_scheduling: bool = False,
):
    return LLM(
        model,
        compilation_config=compilation_for_mode(mode, {"backend": "eager"}),
        dtype="float32",
        max_num_seqs=4,
        num_gpu_blocks_override=num_blocks,
        async_scheduling=async_scheduling,
        speculative_config=SPEC if speculative else None,
    )


class OracleProposer(Proposer):
    """Proposes a request's next tokens from a run without speculation: all right (``right``),
    wrong at a rotating position (``wrong``), or none (``none``)."""

    def __init__(self, references: dict[tuple[int, ...], tuple[list[int], str]]) -> None:
        super().__init__(SpeculativeConfig(num_speculative_tokens=K))
        self.references = references

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        for prompt, (tokens, kind) in self.references.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                proposals = tokens[done : done + K]
                if kind == "wrong" and proposals:
                    position = done % len(proposals)
                    proposals[position] = (proposals[position] + 1) % 256
                return proposals if kind != "none" else []
        raise AssertionError("no reference for this request")


def workload(stop_token: int | None, stop_string: str | None) -> dict[int, list[tuple]]:
    def greedy(max_tokens: int, **fields) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields)

    stop_ids = [] if stop_token is None else [stop_token]
    return {
        0: [
            ("a", [11, 40, 3, 97, 5, 61, 200, 8, 33, 12, 71, 9, 4, 150], greedy(12)),
            (ABORTED, [9, 8, 7, 6, 5, 4], greedy(20)),
            ("b", [3, 1, 4, 1, 5, 9, 2, 6, 5], greedy(16, stop=[stop_string] * bool(stop_string))),
        ],
        1: [("c", [2, 7, 1], greedy(14, stop_token_ids=stop_ids))],
        3: [("d", list(range(100, 120)), greedy(20))],  # crosses block boundaries in runs
        5: [("f", [77, 78, 79, 80, 81, 82, 83], greedy(8)), ("g", [5, 6, 7, 8], greedy(1))],
    }


KINDS = {"a": "right", ABORTED: "right", "b": "right", "c": "right", "d": "wrong", "f": "none"}
KINDS["g"] = "right"


def run(llm: LLM, arrivals: dict[int, list[tuple]]) -> list:
    """Every step's deltas as (request id, token ids, text, finish reason)."""
    processor = OutputProcessor(llm.engine, CharTokenizer())
    steps: list[list[tuple]] = []
    while len(steps) <= max(arrivals) or processor.has_unfinished_requests():
        for request_id, prompt, params in arrivals.get(len(steps), []):
            processor.add_request(prompt, params, request_id=request_id)
        if len(steps) == ABORT_STEP:
            processor.abort_request(ABORTED)
        deltas = processor.step()
        steps.append([(d.request_id, tuple(d.token_ids), d.text, d.finish_reason) for d in deltas])
    assert llm.engine.scheduler.block_manager.num_free_blocks == NUM_BLOCKS  # nothing leaked
    return steps


def stops(reference: dict) -> tuple[int, str]:
    """A stop token from the middle of c's tokens (its first occurrence) and a stop string from
    the middle of b's text: both land inside accepted runs."""
    c_tokens = reference["c"][0]
    index = next(i for i in range(6, len(c_tokens)) if c_tokens[i] not in c_tokens[:i])
    return c_tokens[index], reference["b"][1][7:9]


@pytest.fixture(scope="module")
def plain_run(checkpoint):
    """The workload (its stops taken from a first run) and its results without speculation, in
    eager mode: greedy tokens do not depend on the graph mode."""
    llm = make_llm(checkpoint, "eager", speculative=False, num_blocks=None)
    arrivals = workload(*stops(results(run_unbounded(llm, workload(None, None)))))
    llm.shutdown()
    llm = make_llm(checkpoint, "eager", speculative=False)
    plain = results(run(llm, arrivals))
    llm.shutdown()
    return arrivals, plain


def run_unbounded(llm: LLM, arrivals: dict[int, list[tuple]]) -> list:
    processor = OutputProcessor(llm.engine, CharTokenizer())
    steps = []
    while len(steps) <= max(arrivals) or processor.has_unfinished_requests():
        for request_id, prompt, params in arrivals.get(len(steps), []):
            processor.add_request(prompt, params, request_id=request_id)
        steps.append(
            [(d.request_id, tuple(d.token_ids), d.text, d.finish_reason) for d in processor.step()]
        )
    return steps


@pytest.mark.platform_agnostic
@pytest.mark.parametrize(
    "mode, async_scheduling",
    [
        ("eager", False),
        ("piecewise", False),
        ("full_and_piecewise", False),
        ("breakable", False),
        ("eager", True),
        ("full_and_piecewise", True),
    ],
)
def test_verified_greedy_tokens_equal_decoding_without_speculation(
    checkpoint, plain_run, graph_platform, mode, async_scheduling
):
    arrivals, plain = plain_run
    oracle = OracleProposer(
        {
            tuple(prompt): (plain[request_id][0], KINDS[request_id])
            for step in arrivals.values()
            for request_id, prompt, _ in step
        }
    )

    llm = make_llm(checkpoint, mode, speculative=True, async_scheduling=async_scheduling)
    assert (llm.engine.proposal_backoff is not None) == async_scheduling
    llm.engine.proposer = oracle
    planned, plan = [], llm.engine.runner.plan
    llm.engine.runner.plan = lambda output: planned.append((output, plan(output))) or plan(output)
    steps = run(llm, arrivals)
    stats = llm.engine.scheduler.spec_decoding_stats
    llm.shutdown()
    check_streams(steps)
    spec = results(steps)
    assert {r: v for r, v in spec.items() if r != ABORTED} == {
        r: v for r, v in plain.items() if r != ABORTED
    }
    aborted, plain_aborted = spec[ABORTED][0], plain[ABORTED][0]
    shorter = min(len(aborted), len(plain_aborted))
    assert shorter > 0 and aborted[:shorter] == plain_aborted[:shorter]
    assert spec["b"][2] == "stop" and spec["c"][2] == "stop"
    assert [len(spec[rid][0]) for rid in "adfg"] == [12, 20, 8, 1]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    if mode in ("full_and_piecewise", "breakable"):
        verify_modes = {
            (mode_, descriptor.uniform_query_len)
            for output, (_, mode_, descriptor) in planned
            if output.uniform_decode_query_len == K + 1
        }
        assert (CUDAGraphMode.FULL, K + 1) in verify_modes


def test_preemption_with_proposals_keeps_the_tokens(checkpoint):
    """Three requests of up to 39 KV tokens (3 blocks of 16 each) in 4 blocks: they cannot all
    run; the newest is preempted while the others verify proposals, and resumes."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    arrivals = {
        0: [("p", list(range(20, 40)), params), ("q", [3, 1] * 9, params)],
        1: [("s", list(range(60, 72)), params)],
    }
    plain_llm = make_llm(checkpoint, "eager", speculative=False)
    plain = results(run_unbounded(plain_llm, arrivals))
    plain_llm.shutdown()
    llm = make_llm(checkpoint, "eager", speculative=True)
    llm.engine.proposer = OracleProposer(
        {
            tuple(prompt): (plain[rid][0], "right")
            for step in arrivals.values()
            for rid, prompt, _ in step
        }  # fmt: skip
    )
    schedule, outputs = llm.engine.scheduler.schedule, []
    llm.engine.scheduler.schedule = lambda: outputs.append(schedule()) or outputs[-1]
    assert results(run_unbounded(llm, arrivals)) == plain
    assert llm.engine.scheduler.block_manager.num_free_blocks == NUM_BLOCKS
    assert any(output.preempted_requests for output in outputs)
    assert llm.engine.scheduler.spec_decoding_stats.num_accepted_tokens > 0
    llm.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ngram_proposals_on_repeating_text_are_accepted_and_change_nothing(async_scheduling):
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7]}, {"prompt_token_ids": [1, 2, 3]}]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    plain_llm = make_llm("llama-tiny", "eager", speculative=False, num_blocks=None)
    plain = plain_llm.generate(prompts, params)
    plain_llm.shutdown()
    llm = make_llm(
        "llama-tiny", "eager", speculative=True, num_blocks=None, async_scheduling=async_scheduling
    )
    spec = llm.generate(prompts, params)
    stats = llm.engine.scheduler.spec_decoding_stats
    for with_spec, without in zip(spec, plain):
        assert with_spec.outputs[0].token_ids == without.outputs[0].token_ids
        for entry, reference in zip(with_spec.outputs[0].logprobs, without.outputs[0].logprobs):
            assert entry.keys() == reference.keys()
            for token_id, logprob in entry.items():
                assert logprob.logprob == pytest.approx(reference[token_id].logprob, abs=1e-4)
        assert len(with_spec.outputs[0].logprobs) == 24
    assert stats.acceptance_rate > 0.8 and stats.mean_accepted_length > 2
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=3, ignore_eos=True)
    first, second = (llm.generate(prompts[:1], seeded)[0].outputs[0].token_ids for _ in range(2))
    assert first == second
    llm.shutdown()


class NoProposals(Proposer):
    """Never finds anything to propose, as the n-gram proposer on text that never repeats."""

    def __init__(self) -> None:
        super().__init__(SpeculativeConfig(num_speculative_tokens=K))

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        return []


def test_requests_without_proposals_back_off_to_async_steps(checkpoint, plain_run):
    """With async scheduling, requests whose proposals never come are tried after 1, 2, 4, ...
    up to 16 steps: the steps between tries read their tokens one step late, as without
    speculation (no host sync after the launch), and the tokens are those without it."""
    arrivals, plain = plain_run
    llm = make_llm(checkpoint, "eager", speculative=True, async_scheduling=True)
    llm.engine.proposer = NoProposals()
    decisions, proposes_next = [], llm.engine._proposes_next
    llm.engine._proposes_next = lambda output: (
        decisions.append(proposes_next(output)) or (decisions[-1])
    )
    spec = results(run(llm, arrivals))
    llm.shutdown()
    assert {r: v for r, v in spec.items() if r != ABORTED} == {
        r: v for r, v in plain.items() if r != ABORTED
    }
    # Syncs: one per request's tries (each after 1, 2, 4, 8, 16 ... skipped steps) and the
    # steps where a newly started request is tried; most steps run without one.
    assert 0 < sum(decisions) < len(decisions) / 2


def test_async_engine_streams_verified_runs():
    prompts = [[5, 6, 7, 5, 6, 7], [1, 2, 3], [8] * 11]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def stream_all(speculative: bool) -> tuple[list[list[list[int]]], object]:
        llm = make_llm("llama-tiny", "eager", speculative, num_blocks=None)
        engine = AsyncLLMEngine(InprocEngineClient(llm.engine))

        async def one(index: int) -> list[list[int]]:
            await asyncio.sleep(0.01 * index)  # arrivals while others decode
            chunks = []
            async for delta in engine.generate(prompts[index], params, f"r{index}"):
                assert delta.error is None
                chunks.append(delta.new_token_ids)
            assert delta.finish_reason == "length"
            return chunks

        async def main() -> list[list[list[int]]]:
            engine.start()
            return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

        try:
            return asyncio.run(main()), engine.stats
        finally:
            engine.shutdown()

    (plain, _), (spec, stats) = stream_all(False), stream_all(True)
    for plain_chunks, spec_chunks in zip(plain, spec):
        tokens = [token for chunk in spec_chunks for token in chunk]
        assert tokens == [token for chunk in plain_chunks for token in chunk]
        assert len(tokens) == 12 and len(spec_chunks) < len(tokens)
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens


def test_logit_bias_and_structured_output_beside_verified_requests(checkpoint, tmp_path):
    """A request whose logit_bias makes it repeat one token verifies n-gram proposals of it
    (accepted only under its bias) beside constrained requests, which get none: the free tokens
    equal decoding without speculation and the constrained outputs stay in their language."""
    pytest.importorskip("xgrammar")
    pytest.importorskip("transformers")
    from pieceworks.sampling_params import StructuredOutputsParams
    from tests.engine.tiny_tokenizer import save_tiny_tokenizer

    tokenizer = save_tiny_tokenizer(tmp_path)
    prompts = [[1, 2, 3], [1, 2, 3], "a", "b"]
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    biased = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            logit_bias={9: 12.0})  # fmt: skip
    params = [
        free,
        biased,
        SamplingParams(
            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
            temperature=0.0,
            max_tokens=50,
        ),  # fmt: skip
        SamplingParams(
            structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2}-[a-c]"),
            seed=1,
            max_tokens=50,
        ),  # fmt: skip
    ]

    def generate(speculative: bool):
        llm = LLM(checkpoint, enforce_eager=True, dtype="float32", max_num_seqs=8,
                  tokenizer=tokenizer, async_scheduling=False,
                  speculative_config=SPEC if speculative else None)  # fmt: skip
        outputs = [output.outputs[0] for output in llm.generate(prompts, params)]
        stats = llm.engine.scheduler.spec_decoding_stats
        llm.shutdown()
        return outputs, stats

    (plain, _), (spec, stats) = generate(False), generate(True)
    assert [o.token_ids for o in spec[:2]] == [o.token_ids for o in plain[:2]]
    assert spec[1].token_ids == [9] * 12 and spec[0].token_ids != spec[1].token_ids
    assert spec[2].text in ("yes", "no") and spec[2].text == plain[2].text
    assert re.fullmatch(r"[0-9]{2}-[a-c]", spec[3].text)
    assert stats.num_accepted_tokens > 0
