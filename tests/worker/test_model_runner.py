"""``ModelRunner`` on the CPU, eager (no graphs): its set-up, its step layouts and its messages.

Proves: the weights do not require grad; load and first-forward times are recorded; the token
budget is the larger of ``max_num_batched_tokens`` and the largest capture size; a model
without Mamba layers has no state slots; the KV cache is bound to every attention layer with
``num_blocks`` blocks; the profiling step is prefills no longer than ``max_model_len``; capture
layouts are one token per sequence for decodes and one token per sequence up to
``max_num_seqs`` otherwise; without graphs a step is not padded, and a batch shape's plan is
worked out once; the out-of-memory message in capture names every setting in full; a seeded
request gets one generator, kept until ``release``; the two pinned staging buffers alternate.
llama-tiny at level 0 on CPU, float32.
Run: pytest tests/worker/test_model_runner.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.config import CUDAGraphMode
from pieceworks.core.cudagraph_dispatcher import BatchDescriptor
from pieceworks.engine.llm import LLM
from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.request import Request
from pieceworks.worker.input_buffers import StepShape
from pieceworks.worker.kv_cache import GIB, attention_layers


@pytest.fixture(scope="module")
def llm():
    return LLM(
        "llama-tiny",
        compilation_config={"level": 0},
        dtype="float32",
        max_num_seqs=4,
        max_model_len=64,
        max_num_batched_tokens=100,
    )


def test_set_up_fields(llm):
    runner = llm.engine.runner
    assert all(not p.requires_grad for p in runner.model.parameters())
    assert runner.load_seconds > 0.0 and runner.profiler.compile_seconds > 0.0
    assert runner.max_num_tokens == max(100, runner.compilation.max_capture_size)
    assert runner.mamba_spec is None and runner.num_state_slots == 0
    assert runner.block_size == 16
    assert runner.num_blocks == llm.engine.scheduler.block_manager.num_blocks == 4 * 4
    for layer in attention_layers(runner.config):
        key, value = layer._kv_cache
        assert key.shape[0] == value.shape[0] == runner.num_blocks
    assert runner.compilation.cudagraph_mode == CUDAGraphMode.NONE
    assert runner.forward_model is runner.model  # no graph wrapper without graphs
    assert runner.release_graphs() == 0


def test_profile_and_capture_layouts(llm):
    runner = llm.engine.runner
    # 200 tokens as prefills of at most 64: 4 sequences (max_num_seqs) of up to 50
    assert runner.graphs.profile_shape(200) == StepShape(200, 200, 4, 4, 50)
    assert runner.graphs.profile_shape(100) == StepShape(100, 100, 2, 2, 50)
    assert runner.graphs.profile_shape(10) == StepShape(10, 10, 1, 1, 10)
    assert runner.graphs.capture_shape(BatchDescriptor(8, True)) == StepShape(8, 8, 8, 8, 1)
    assert runner.graphs.capture_shape(BatchDescriptor(8, False)) == StepShape(8, 8, 4, 4, 8)
    assert runner.graphs.capture_shape(BatchDescriptor(2, False)) == StepShape(2, 2, 2, 2, 2)


def test_without_graphs_a_step_is_not_padded_and_each_plan_is_kept(llm):
    runner = llm.engine.runner
    shape, mode, descriptor = runner._plan(3, 2, 2, False)
    assert (shape, mode, descriptor) == (StepShape(3, 3, 2, 2, 2), CUDAGraphMode.NONE, None)
    big = runner.compilation.max_capture_size + 5
    assert runner._plan(big, 3, big, False) == (
        StepShape(big, big, 3, 3, big),
        CUDAGraphMode.NONE,
        None,
    )
    runner._plans.clear()
    engine = llm.engine
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    keys = set(runner._plans)
    assert (3, 1, 3, False) in keys  # the prefill: 3 tokens, 1 request
    assert (1, 1, 1, True) in keys  # the decodes
    assert runner._plans[(3, 1, 3, False)][0] == StepShape(3, 3, 1, 1, 3)


def test_out_of_memory_in_capture_message_in_full(llm):
    runner = llm.engine.runner
    estimate = runner.graphs.graph_memory_estimate_bytes
    try:
        runner.graphs.graph_memory_estimate_bytes = GIB * 3 // 2
        message = runner.graphs.capture_oom_message(7)
    finally:
        runner.graphs.graph_memory_estimate_bytes = estimate
    assert message == (
        "out of device memory while capturing 7 graph shapes (1.50 GiB was estimated for their "
        "graphs and held back from the KV cache). Lower gpu_memory_utilization (now 0.9) to "
        "leave more outside the KV cache, or capture fewer or smaller sizes (lower "
        "max_num_seqs, now 4, or set cudagraph_capture_sizes), or run without graphs "
        "(cudagraph_mode=NONE)."
    )


def test_a_seeded_request_keeps_one_generator_until_released(llm):
    runner = llm.engine.runner
    seeded = Request("seeded", [1], SamplingParams(temperature=1.0, seed=3))
    greedy = Request("greedy", [1], SamplingParams(temperature=0.0))
    generator = runner._generator(seeded)
    assert isinstance(generator, torch.Generator)
    assert runner._generator(seeded) is generator
    assert runner._generator(greedy) is None
    assert runner.generators == {"seeded": generator, "greedy": None}
    runner.release("seeded")
    runner.release("greedy")
    runner.release("never seen")
    assert runner.generators == {}


def test_the_two_staging_buffers_alternate(llm):
    runner = llm.engine.runner
    assert len(runner._token_staging) == 2
    assert all(buffer.shape == (4,) for buffer in runner._token_staging)  # max_num_seqs x 1 step
    engine = llm.engine
    engine.add_request([5, 6], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    output = engine.scheduler.schedule()
    first = runner.execute_async(output)
    first_ids = first.tolist()
    assert len(first_ids) == 1
    engine.scheduler.update_from_output(output, first_ids)
    output = engine.scheduler.schedule()
    second = runner.execute_async(output)
    assert first.host_ids.data_ptr() != second.host_ids.data_ptr()
    assert first.tolist() == first_ids  # the handle still reads its own step's ids
    assert runner.last_sampled.tolist() == second.tolist()
    assert set(runner.last_sampled_rows) == {output.scheduled_requests[0].request.request_id}
    engine.scheduler.update_from_output(output, second.tolist())
    while engine.has_unfinished_requests():
        engine.step()
