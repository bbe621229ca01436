"""A hybrid (Mamba2 + attention) model through the engine on CPU: pieces, graphs, state slots.

Proves: the split gives 2(A+M)+1 pieces, A+M+1 of them capturable, for A attention and M Mamba
layers; greedy tokens are identical across compile levels and graph modes (on the simgraph example
platform, whose replay really reads the captured buffers), with decode batches padded onto the
null state slot; multi-step decode (``num_scheduler_steps=4``) gives the same tokens; preemption
recomputes a request's state from scratch and gives the same tokens; a reused slot's stale state
is ignored; a model without attention layers runs; every state slot
and KV block is free again at the end; a state cache too big for memory is a clear error.
Run: pytest tests/engine/test_bamba_engine.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.benchmarks.modes import compilation_for_mode
from pieceworks.core.counters import compilation_counter
from pieceworks.engine.llm import LLM
from pieceworks.models.loading.presets import get_preset, random_hf_checkpoint
from pieceworks.sampling_params import SamplingParams

NUM_ATTENTION, NUM_MAMBA = 2, 3
HF_CONFIG = {**get_preset("bamba-tiny"), "num_hidden_layers": 5, "attn_layer_indices": [1, 3]}
MAX_NUM_SEQS = 4


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("bamba-hybrid")
    random_hf_checkpoint(HF_CONFIG, path, seed=4, dtype=torch.float32)
    return str(path)


def make_llm(path: str, mode: str, **engine_args) -> LLM:
    compilation = compilation_for_mode(mode, {"backend": "eager"})
    engine_args.setdefault("max_num_seqs", MAX_NUM_SEQS)
    return LLM(path, compilation_config=compilation, dtype="float32", **engine_args)


def generate(llm: LLM, batch: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    outputs = llm.generate(batch, [greedy(n) for n in max_tokens])
    return [out.outputs[0].token_ids for out in outputs]


def assert_all_freed(llm: LLM) -> None:
    scheduler = llm.engine.scheduler
    assert scheduler.state_slot_manager is not None  # the hybrid model was given state slots
    assert scheduler.state_slot_manager.num_free_slots == llm.engine.runner.num_state_slots - 1
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


@pytest.mark.platform_agnostic
def test_pieces_and_captures_of_a_hybrid(checkpoint, graph_platform):
    num_layers = NUM_ATTENTION + NUM_MAMBA  # each layer has one split op: attention or mixer
    # Pieces: one per split op plus the runs between them, 2 * 5 + 1 = 11; capturable: the 5 + 1
    # runs. max_num_seqs 4 gives capture sizes 1, 2, 4, 8: FULL decode graphs for the three sizes
    # <= 4, each with its decode tail and its masked tail, and PIECEWISE graphs of every
    # capturable piece for all four sizes.
    with compilation_counter.expect(
        num_graphs_seen=1,
        num_piecewise_graphs_seen=2 * num_layers + 1,
        num_piecewise_capturable_graphs_seen=num_layers + 1,
        num_gpu_runner_capture_triggers=1,
        num_cudagraph_captured=3 * 3 + 4 * (num_layers + 1),
        num_decode_tails_captured=3 + 3,
    ):
        llm = make_llm(checkpoint, "full_and_piecewise")
    with compilation_counter.expect(num_cudagraph_captured=0, num_graphs_seen=0):
        generate(llm, prompts([4, 7]), [3, 3])


# Five prompts, four slots, staggered lengths: prefills, mixed steps, and decode batches of 3
# padded to 4 (the padded sequence on the null state slot).
BATCH, MAX_TOKENS = prompts([3, 9, 17, 5, 2]), [6, 4, 6, 5, 6]


@pytest.fixture(scope="module")
def eager_tokens(checkpoint) -> list[list[int]]:
    return generate(make_llm(checkpoint, "eager"), BATCH, MAX_TOKENS)


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("mode", ["compiled", "piecewise", "full", "full_and_piecewise"])
def test_tokens_identical_across_levels_and_graph_modes(
    checkpoint, eager_tokens, graph_platform, mode
):
    llm = make_llm(checkpoint, mode)
    assert generate(llm, BATCH, MAX_TOKENS) == eager_tokens
    assert_all_freed(llm)


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("mode", ["eager", "full_and_piecewise"])
def test_multi_step_decode_gives_the_same_tokens(checkpoint, eager_tokens, graph_platform, mode):
    """Runs of up to 4 decode steps: each step's Mamba state update continues from the one
    before on the device, in the request's own slot (FULL decode graphs replayed per step)."""
    llm = make_llm(checkpoint, mode, num_scheduler_steps=4)
    schedule, num_steps = llm.engine.scheduler.schedule, []

    def recording_schedule():
        output = schedule()
        num_steps.append(output.num_steps)
        return output

    llm.engine.scheduler.schedule = recording_schedule
    assert generate(llm, BATCH, MAX_TOKENS) == eager_tokens
    assert max(num_steps) == 4
    assert_all_freed(llm)


def test_preempted_request_recomputes_its_state(checkpoint):
    # 5 blocks of 16 tokens; two requests of 20 + 30 tokens need 4 blocks each: the newer one is
    # preempted, later re-admitted with a fresh state slot and recomputed from its first token.
    batch = prompts([20, 20], seed=2)
    llm = make_llm(checkpoint, "eager", max_num_seqs=2, num_gpu_blocks_override=5)
    requests = [llm.engine.add_request(prompt, greedy(30)) for prompt in batch]
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert sum(request.num_preemptions for request in requests) > 0
    reference = generate(make_llm(checkpoint, "eager", max_num_seqs=2), batch, [30, 30])
    assert [request.output_token_ids for request in requests] == reference
    assert_all_freed(llm)


def test_model_without_attention_layers_reuses_slots_cleanly(tmp_path):
    # No KV cache at all; the second batch gets the slots the first left its final states in,
    # and must start from zeros, not from those states.
    hf_config = {**HF_CONFIG, "num_hidden_layers": 2, "attn_layer_indices": []}
    random_hf_checkpoint(hf_config, tmp_path, seed=5, dtype=torch.float32)
    llm = make_llm(str(tmp_path), "eager")
    first = generate(llm, prompts([6, 3]), [3, 3])
    assert generate(llm, prompts([6, 3]), [3, 3]) == first
    assert_all_freed(llm)


def test_state_cache_that_does_not_fit_is_a_clear_error(checkpoint):
    from pieceworks.worker.mamba_cache import allocate_mamba_cache

    spec = make_llm(checkpoint, "eager").engine.runner.mamba_spec
    assert spec is not None and spec.num_slots == MAX_NUM_SEQS + 1
    with pytest.raises(RuntimeError, match="Lower max_num_seqs"):
        allocate_mamba_cache(spec, torch.device("cpu"), free_bytes=spec.num_bytes - 1)
