"""Prefix caching through the real engine and model runner on CPU (llama-tiny, eager).

Proves: the runner needs nothing new for a request whose first blocks come from the cache (its
positions start at ``num_computed_tokens``, its block table lists the cached blocks, as for a
prompt chunk): with requests arriving at different steps, shared and unshared prompts, a wholly
cached prompt, an abort mid-run and a KV cache small enough to force preemption, greedy tokens are
identical with prefix caching on and off, the cache was hit, and every block is free again at the
end; a request asking for prompt_logprobs gets the same values as without the cache; the engine's
stats carry the hit counters; a hybrid model (bamba-tiny) runs with prefix caching off and says so
once in the log.

Run: ``PIECEWORKS_PLATFORM=cpu pytest tests/engine/test_prefix_caching.py -q``
"""

from __future__ import annotations

import logging

import pytest
import torch

from pieceworks.benchmarks.modes import compilation_for_mode
from pieceworks.engine.core_loop import EngineCoreLoop
from pieceworks.engine.llm import LLM
from pieceworks.sampling_params import SamplingParams
from tests.engine.test_host_path import save_scaled_llama_tiny

NUM_BLOCKS = 6  # of 16 tokens: 4 requests of up to 3 blocks each do not fit at once
ABORTED = "aborted"


def tokens(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=generator).tolist()


def greedy(max_tokens: int, **fields) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields)


SYSTEM = tokens(21, seed=1)  # a shared "system prompt" of one full block and a part
ARRIVALS = {  # step -> (request id, prompt, max_tokens) arriving before it
    0: [("a", SYSTEM + tokens(5, 2), 20), ("u", tokens(9, 3), 6), (ABORTED, SYSTEM, 30)],
    2: [("b", SYSTEM + tokens(12, 4), 20), ("c", SYSTEM + tokens(3, 5), 24)],
    4: [("d", SYSTEM + tokens(5, 2), 6), ("e", tokens(9, 3), 4)],  # a's and u's prompts again
    6: [("f", SYSTEM + tokens(5, 2) + tokens(6, 7), 5), ("g", tokens(32, 8), 3)],
}
ABORT_STEP = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_scaled_llama_tiny(tmp_path_factory.mktemp("llama-tiny-prefix"))


def make_llm(checkpoint: str, enable_prefix_caching: bool, num_blocks=NUM_BLOCKS) -> LLM:
    return LLM(
        checkpoint,
        compilation_config=compilation_for_mode("eager", {"backend": "eager"}),
        dtype="float32",
        max_num_seqs=4,
        num_gpu_blocks_override=num_blocks,
        enable_prefix_caching=enable_prefix_caching,
    )


def run(llm: LLM) -> tuple[dict[str, list[int]], int]:
    """Each request's tokens (the aborted one's left out) and the number of preemptions."""
    engine, requests, num_preempted, step = llm.engine, {}, 0, 0
    schedule = engine.scheduler.schedule

    def counting_schedule():
        nonlocal num_preempted
        output = schedule()
        num_preempted += len(output.preempted_requests)
        return output

    engine.scheduler.schedule = counting_schedule
    while step <= max(ARRIVALS) or engine.has_unfinished_requests():
        for request_id, prompt, max_tokens in ARRIVALS.get(step, []):
            requests[request_id] = engine.add_request(prompt, greedy(max_tokens), request_id)
        if step == ABORT_STEP:
            assert engine.abort_request(ABORTED)
        engine.step()
        step += 1
    engine.scheduler.schedule = schedule
    manager = engine.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks  # nothing leaked
    del requests[ABORTED]
    return {rid: list(r.output_token_ids) for rid, r in requests.items()}, num_preempted


@pytest.fixture(scope="module")
def without_cache(checkpoint):
    llm = make_llm(checkpoint, enable_prefix_caching=False)
    result = run(llm)
    assert llm.engine.scheduler.block_manager.num_prefix_cache_queries == 0
    llm.shutdown()
    return result


def test_greedy_tokens_are_the_same_with_and_without_prefix_caching(checkpoint, without_cache):
    llm = make_llm(checkpoint, enable_prefix_caching=True)
    cached, num_preempted = run(llm)
    assert cached == without_cache[0]
    assert num_preempted > 0 and without_cache[1] > 0  # the small KV cache forced preemption
    stats = EngineCoreLoop(llm.engine).stats()
    assert 0 < stats.prefix_cache_hits < stats.prefix_cache_queries
    # Run again on the warm cache: wholly cached prompts (their last block recomputed) too.
    again, _ = run(llm)
    assert again == cached
    assert EngineCoreLoop(llm.engine).stats().prefix_cache_hits > stats.prefix_cache_hits
    llm.shutdown()


def test_prompt_logprobs_are_the_same_with_a_warm_cache(checkpoint):
    params = greedy(2, prompt_logprobs=3)
    prompt = SYSTEM + tokens(4, 9)
    results = []
    for enable in (False, True):
        llm = make_llm(checkpoint, enable_prefix_caching=enable, num_blocks=16)
        llm.generate([prompt], [greedy(2)])  # warms the cache when it is on
        (output,) = llm.generate([prompt], [params])
        results.append(output)
        manager = llm.engine.scheduler.block_manager
        assert manager.num_cached_blocks == (1 if enable else 0)  # 25 + 1 KV tokens: 1 full block
        llm.shutdown()
    plain, warm = results
    assert warm.outputs[0].token_ids == plain.outputs[0].token_ids
    assert len(warm.prompt_logprobs) == len(prompt)
    for with_cache, without in zip(warm.prompt_logprobs[1:], plain.prompt_logprobs[1:]):
        assert with_cache.keys() == without.keys()
        for token_id, entry in with_cache.items():
            assert entry.logprob == pytest.approx(without[token_id].logprob, abs=1e-5)


def test_a_hybrid_model_turns_prefix_caching_off_with_a_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="pieceworks"):
        llm = LLM(
            "bamba-tiny",
            compilation_config=compilation_for_mode("eager", {"backend": "eager"}),
            dtype="float32",
            max_num_seqs=2,
        )
    assert not llm.engine.scheduler.block_manager.enable_prefix_caching
    lines = [r.getMessage() for r in caplog.records if "prefix caching is off" in r.getMessage()]
    assert len(lines) == 1
    prompt = tokens(20, seed=3)
    first, second = llm.generate([prompt, prompt], [greedy(3), greedy(3)])
    assert first.outputs[0].token_ids == second.outputs[0].token_ids
    assert llm.engine.scheduler.block_manager.num_prefix_cache_queries == 0
    llm.shutdown()
