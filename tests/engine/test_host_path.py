"""The engine's fast host path changes nothing a caller can observe.

The runner's input buffers update their staging buffers incrementally (block-table rows only where
block ids changed, layout-only fields skipped for a step laid out like the buffer's last one).
One mixed workload (requests arriving at different steps, more of them than seats, a small KV
cache that forces preemption, a stop token, a stop string, an abort mid-run, varied
``max_tokens``) runs through ``OutputProcessor`` streaming three ways:

- the engine as it is;
- the reference: the same engine with ``StepInputs.reset_staged()`` before every step, so
  every field of every step is written in full, as a fresh buffer would be;
- the engine with async scheduling off.

The first two must give identical deltas step for step (token ids, text, finish reasons, in the
same order), in eager mode and with FULL and PIECEWISE graphs (on the simgraph platform, whose
replay reads the captured buffers, so a field left stale would show). Without async scheduling
every request but the aborted one must end with the same tokens and finish reason, and the
requests must finish in the same order.

Run: ``PIECEWORKS_PLATFORM=cpu pytest tests/engine/test_host_path.py -q``
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pieceworks.benchmarks.modes import compilation_for_mode
from pieceworks.engine.llm import LLM
from pieceworks.engine.output_processor import OutputProcessor
from pieceworks.models.loading.hf_directory import save_hf_directory
from pieceworks.models.loading.presets import get_preset, random_hf_weights
from pieceworks.sampling_params import SamplingParams

ABORTED = "e"
ABORT_STEP = 5
NUM_BLOCKS = 4  # of 16 tokens, for up to 4 running requests of up to 3 blocks: preemption


class CharTokenizer:
    """One letter per token id: enough text for stop strings, with no files to load."""

    def decode(self, token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(ord("a") + token_id % 26) for token_id in token_ids)


def workload(stop_string: str | None, stop_token: int | None) -> dict[int, list[tuple]]:
    """Step -> the requests (id, prompt, params) that arrive before it."""
    generator = torch.Generator().manual_seed(11)

    def prompt(length: int) -> list[int]:
        return torch.randint(0, 256, (length,), generator=generator).tolist()

    def greedy(max_tokens: int, **fields: Any) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **fields)

    def seeded(max_tokens: int, seed: int, **fields: Any) -> SamplingParams:
        """Random sampling from the request's own generator: the same tokens in any batch (and
        varied ones: a random-weight model's greedy tokens repeat, too few to stop on)."""
        return SamplingParams(
            temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed, **fields
        )

    stop = [stop_string] if stop_string else []
    stop_token_ids = [stop_token] if stop_token is not None else []
    return {
        0: [
            ("a", prompt(14), greedy(12)),
            (ABORTED, prompt(6), greedy(20)),  # aborted between two running requests
            ("b", prompt(9), seeded(16, 1, stop=stop)),
        ],
        2: [("c", prompt(3), seeded(10, 2, stop_token_ids=stop_token_ids))],
        3: [("d", prompt(20), greedy(20))],  # crosses a block boundary while decoding
        5: [("f", prompt(7), seeded(8, 3)), ("g", prompt(4), greedy(1))],
    }


def run(llm: LLM, arrivals: dict[int, list[tuple]], before_step: Callable[[], None]) -> list:
    """Every step's deltas as (request id, token ids, text, finish reason)."""
    processor = OutputProcessor(llm.engine, CharTokenizer())
    steps: list[list[tuple]] = []
    while len(steps) <= max(arrivals) or processor.has_unfinished_requests():
        for request_id, prompt, params in arrivals.get(len(steps), []):
            processor.add_request(prompt, params, request_id=request_id)
        if len(steps) == ABORT_STEP:
            processor.abort_request(ABORTED)
        before_step()
        deltas = processor.step()
        steps.append([(d.request_id, tuple(d.token_ids), d.text, d.finish_reason) for d in deltas])
    assert llm.engine.scheduler.block_manager.num_free_blocks == NUM_BLOCKS  # nothing leaked
    return steps


def results(steps: list) -> dict[str, tuple[list[int], str, str | None]]:
    """Request id -> (all its tokens, all its text, its finish reason)."""
    out: dict[str, tuple[list[int], str, str | None]] = {}
    for deltas in steps:
        for request_id, token_ids, text, reason in deltas:
            tokens, so_far, _ = out.get(request_id, ([], "", None))
            out[request_id] = (tokens + list(token_ids), so_far + text, reason)
    return out


def finish_order(steps: list) -> list[str]:
    return [rid for deltas in steps for rid, _, _, reason in deltas if reason is not None]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_scaled_llama_tiny(tmp_path_factory.mktemp("llama-tiny"))


def save_scaled_llama_tiny(path) -> str:
    """llama-tiny with weights 10x the preset's scale: at the preset's scale the logits barely
    depend on the context (greedy decoding repeats one token), so a wrong KV cache entry or
    position would go unseen."""
    hf_config = get_preset("llama-tiny")
    weights = {
        name: tensor if name.endswith("norm.weight") else tensor * 10
        for name, tensor in random_hf_weights(hf_config, seed=5)
    }
    save_hf_directory(weights, {**hf_config, "torch_dtype": "float32"}, path)
    return str(path)


def make_llm(
    checkpoint: str, mode: str, async_scheduling: bool = True, num_scheduler_steps: int = 1
) -> LLM:
    return LLM(
        checkpoint,
        compilation_config=compilation_for_mode(mode, {"backend": "eager"}),
        dtype="float32",
        max_num_seqs=4,
        num_gpu_blocks_override=NUM_BLOCKS,
        async_scheduling=async_scheduling,
        num_scheduler_steps=num_scheduler_steps,
    )


def stops_from_a_first_run(llm: LLM) -> tuple[str, int]:
    """A stop string from the middle of b's text and a stop token from the middle of c's."""
    first = results(run(llm, workload(None, None), lambda: None))
    return first["b"][1][4:6], first["c"][0][4]


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("mode", ["eager", "full_and_piecewise"])
def test_incremental_buffers_match_full_rewrite_step_for_step(checkpoint, graph_platform, mode):
    sync_llm = make_llm(checkpoint, mode, async_scheduling=False)
    arrivals = workload(*stops_from_a_first_run(sync_llm))
    sync = run(sync_llm, arrivals, lambda: None)
    sync_llm.shutdown()

    llm = make_llm(checkpoint, mode)  # fresh: its first run allocates blocks from 0 in order
    schedule, outputs = llm.engine.scheduler.schedule, []
    llm.engine.scheduler.schedule = lambda: outputs.append(schedule()) or outputs[-1]
    fast = run(llm, arrivals, lambda: None)
    assert sum(len(output.preempted_requests) for output in outputs) > 0
    reference = run(llm, arrivals, llm.engine.runner.inputs.reset_staged)
    assert fast == reference
    final = results(fast)
    assert final["b"][2] == "stop" and len(final["b"][0]) < 16  # the stop string
    assert final["c"][2] == "stop" and len(final["c"][0]) < 10  # the stop token
    # An aborted request is forgotten at once: no delta from the abort on, no finish delta.
    assert final[ABORTED][2] is None and 0 < len(final[ABORTED][0]) < 20
    assert not [d for deltas in fast[ABORT_STEP:] for d in deltas if d[0] == ABORTED]
    assert final["a"][2] == final["d"][2] == final["g"][2] == "length"
    assert [len(final[rid][0]) for rid in "adg"] == [12, 20, 1]

    sync_final = results(sync)
    assert {rid: r for rid, r in final.items() if rid != ABORTED} == {
        rid: r for rid, r in sync_final.items() if rid != ABORTED
    }
    assert [r for r in finish_order(fast) if r != ABORTED] == [
        r for r in finish_order(sync) if r != ABORTED
    ]
