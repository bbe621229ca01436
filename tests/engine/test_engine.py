"""The engine end to end on CPU: HF-equal greedy tokens, identical across levels and graph modes.

Also the padding/dispatch path, capture-once counters, rejection of requests that never fit, and
many more requests than ``max_num_seqs`` with preemption (counted, and every output equal to an
unpreempted run). Graph modes run on the simgraph example platform, whose
replay really reads the captured buffers, so a runner that forgot to copy an input would fail.
Run: pytest tests/engine/test_engine.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.core.config import CUDAGraphMode
from pieceworks.core.counters import compilation_counter
from pieceworks.engine.llm import LLM
from pieceworks.models.loading.presets import random_hf_checkpoint
from pieceworks.sampling_params import SamplingParams
from pieceworks.scheduler.output import ScheduledRequest, SchedulerOutput

transformers = pytest.importorskip("transformers")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llama-tiny")
    random_hf_checkpoint("llama-tiny", path, seed=3, dtype=torch.float32)
    return str(path)


def hf_greedy(path: str, prompt: list[int], max_tokens: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def generate(path: str, mode: str, batch: list[list[int]], **engine_args) -> list[list[int]]:
    from pieceworks.benchmarks.modes import compilation_for_mode

    llm = LLM(
        path,
        compilation_config=compilation_for_mode(mode, {"backend": "eager"}),
        dtype="float32",
        max_num_seqs=4,
        **engine_args,
    )
    return [out.outputs[0].token_ids for out in llm.generate(batch, GREEDY)]


def test_greedy_equals_hf_step_by_step(checkpoint):
    batch = prompts([3, 9, 17])
    engine_tokens = generate(checkpoint, "eager", batch)
    assert engine_tokens == [hf_greedy(checkpoint, p, GREEDY.max_tokens) for p in batch]


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("mode", ["compiled", "piecewise", "full", "full_and_piecewise"])
def test_tokens_identical_across_levels_and_graph_modes(checkpoint, graph_platform, mode):
    batch = prompts([3, 9, 17, 5, 2])  # five prompts, four slots: a mixed, queued workload
    assert generate(checkpoint, mode, batch) == generate(checkpoint, "eager", batch)


@pytest.mark.platform_agnostic
def test_capture_once_per_size_and_never_while_serving(checkpoint, graph_platform):
    from pieceworks.benchmarks.modes import compilation_for_mode

    compilation = compilation_for_mode("full_and_piecewise", {"backend": "eager"})
    # max_num_seqs 4 gives capture sizes 1, 2, 4, 8. FULL decode graphs for the sizes <= 4 (three),
    # each followed by its decode tail and its masked tail (one step per run: two tails per size),
    # and PIECEWISE graphs of llama-tiny's 2 * 2 + 1 pieces (2 + 1 capturable) for all four sizes.
    with compilation_counter.expect(
        num_gpu_runner_capture_triggers=1,
        num_cudagraph_captured=3 + 3 + 3 + 4 * 3,
        num_decode_tails_captured=3 + 3,
    ):
        llm = LLM(checkpoint, compilation_config=compilation, dtype="float32", max_num_seqs=4)
    with compilation_counter.expect(num_cudagraph_captured=0, num_graphs_seen=0):
        llm.generate(prompts([4, 6, 8]), GREEDY)


@pytest.mark.platform_agnostic
def test_shutdown_releases_the_graphs_of_that_engine_only(checkpoint, graph_platform):
    """Shutdown drops the engine's graphs (NCCL destroys no communicator a live graph holds, and
    Dynamo's cache keeps the piece wrappers alive); another engine's graphs stay and replay."""
    from pieceworks.benchmarks.modes import compilation_for_mode

    compilation = compilation_for_mode("full_and_piecewise", {"backend": "eager"})
    engines = [
        LLM(checkpoint, compilation_config=compilation, dtype="float32", max_num_seqs=4)
        for _ in range(2)
    ]
    pool = graph_platform.graph_pool()
    engines[0].shutdown()
    assert engines[0].engine.runner.release_graphs() == 0
    with pytest.raises(RuntimeError, match="shut down.*build a new LLM"):
        engines[0].generate(prompts([4]), GREEDY)
    assert graph_platform.graph_pool() is not pool  # CUDA: a drained pool takes no new captures
    with compilation_counter.expect(num_cudagraph_captured=0):
        tokens = [out.outputs[0].token_ids for out in engines[1].generate(prompts([4, 6]), GREEDY)]
    assert tokens == generate(checkpoint, "eager", prompts([4, 6]))
    assert engines[1].engine.runner.release_graphs() == 3 + 3 + 3 + 4 * 3  # as counted above


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_a_deleted_engine_frees_its_model(checkpoint, graph_platform, mode):
    """Deleting an ``LLM`` frees its model, weights and KV cache (no shutdown needed), while an
    engine of the same model class beside it keeps generating: neither Dynamo's backend cache
    nor the model module's globals keep a compiled model alive."""
    import gc
    import weakref

    from pieceworks.benchmarks.modes import compilation_for_mode

    compilation = compilation_for_mode(mode, {"backend": "eager"})
    kept, deleted = (
        LLM(checkpoint, compilation_config=compilation, dtype="float32", max_num_seqs=4)
        for _ in range(2)
    )
    expected = generate(checkpoint, "eager", prompts([4, 6]))
    for llm in (kept, deleted, kept):  # the two engines' compiled code called in turn
        assert [out.outputs[0].token_ids for out in llm.generate(prompts([4, 6]), GREEDY)] == (
            expected
        )
    model = weakref.ref(deleted.engine.runner.model)
    del deleted, llm
    gc.collect()
    assert model() is None
    tokens = [out.outputs[0].token_ids for out in kept.generate(prompts([4, 6]), GREEDY)]
    assert tokens == expected


def _output(llm: LLM, lengths: list[int], computed: list[int]) -> SchedulerOutput:
    from pieceworks.scheduler.request import Request

    scheduled = []
    for i, (n, done) in enumerate(zip(lengths, computed)):
        request = Request(str(i), list(range(done + n)))
        request.num_computed_tokens = done
        scheduled.append(ScheduledRequest(request, n))
    return SchedulerOutput(scheduled)


@pytest.mark.platform_agnostic
def test_padding_and_dispatch(checkpoint, graph_platform):
    from pieceworks.benchmarks.modes import compilation_for_mode

    llm = LLM(
        checkpoint,
        compilation_config=compilation_for_mode("full_and_piecewise", {"backend": "eager"}),
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=32,
    )
    runner = llm.engine.runner
    shape, mode, descriptor = runner.plan(_output(llm, [1, 1, 1], [4, 5, 6]))  # 3 decodes
    assert (mode, descriptor.num_tokens, descriptor.uniform_decode) == (CUDAGraphMode.FULL, 4, True)
    assert (shape.num_tokens, shape.num_tokens_padded, shape.num_seqs_padded) == (3, 4, 4)
    shape, mode, descriptor = runner.plan(_output(llm, [1, 2], [4, 0]))  # mixed, 3 tokens
    assert (mode, descriptor.num_tokens, descriptor.uniform_decode) == (
        CUDAGraphMode.PIECEWISE,
        4,
        False,
    )
    assert (shape.num_tokens_padded, shape.num_seqs_padded) == (4, 2)
    shape, mode, descriptor = runner.plan(_output(llm, [20], [0]))  # beyond the capture sizes
    assert (mode, descriptor, shape.num_tokens_padded) == (CUDAGraphMode.NONE, None, 20)
    metadata = runner.inputs.prepare(
        _output(llm, [1, 1, 1], [4, 5, 6]).scheduled_requests,
        runner.plan(_output(llm, [1, 1, 1], [4, 5, 6]))[0],
    )
    assert metadata.slot_mapping.tolist()[3] == -1  # the padded token is never stored
    assert metadata.seq_lens.tolist() == [5, 6, 7, 0]  # the padded sequence is empty
    assert metadata.query_start_loc.tolist() == [0, 1, 2, 3, 3]


def test_request_that_never_fits_is_rejected(checkpoint):
    llm = LLM(checkpoint, compilation_config={"level": 0}, dtype="float32", max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(30))], SamplingParams(max_tokens=8))


def test_many_more_requests_than_max_num_seqs_with_preemption(checkpoint):
    """3 blocks of 16 tokens for 2 running requests of up to 11 + 20 tokens (2 blocks each)."""
    batch = prompts([5 + i % 7 for i in range(12)], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

    def run(**engine_args):
        llm = LLM(checkpoint, compilation_config={"level": 0}, dtype="float32", **engine_args)
        schedule, steps = llm.engine.scheduler.schedule, []
        llm.engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
        outputs = [out.outputs[0].token_ids for out in llm.generate(batch, params)]
        num_preempted = sum(len(step.preempted_requests) for step in steps)
        return llm, outputs, num_preempted

    llm, outputs, num_preempted = run(max_num_seqs=2, num_gpu_blocks_override=3)
    assert num_preempted > 0
    assert [len(tokens) for tokens in outputs] == [20] * 12
    assert llm.engine.scheduler.block_manager.num_free_blocks == 3  # nothing leaked
    _, reference, reference_preempted = run(max_num_seqs=4)  # ample blocks, other batches
    assert reference_preempted == 0
    assert outputs == reference


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("mode", ["eager", "full_and_piecewise"])
def test_async_scheduling_gives_the_tokens_of_sync_scheduling(checkpoint, graph_platform, mode):
    """Step N+1 launched before step N's tokens are read: same tokens and finish reasons.

    Stop tokens taken from a first run make requests stop early, so some stop on a token that
    arrives after their next step was launched (its extra token must be dropped); a small KV
    cache forces preemption with tokens in flight; max_tokens varies per request.
    """
    from pieceworks.benchmarks.modes import compilation_for_mode

    batch = prompts([5 + i % 7 for i in range(10)], seed=6)

    def run(async_scheduling: bool, params: list[SamplingParams]):
        llm = LLM(
            checkpoint,
            compilation_config=compilation_for_mode(mode, {"backend": "eager"}),
            dtype="float32",
            max_num_seqs=4,
            num_gpu_blocks_override=6,  # 6 blocks of 16 tokens for 4 running: preemption
            async_scheduling=async_scheduling,
        )
        outputs = llm.generate(batch, params)
        assert llm.engine.scheduler.block_manager.num_free_blocks == 6  # nothing leaked
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]

    lengths = [SamplingParams(temperature=0.0, max_tokens=4 + i % 9) for i in range(len(batch))]
    first = run(False, lengths)
    stops = [
        SamplingParams(temperature=0.0, max_tokens=p.max_tokens, stop_token_ids=[t[len(t) // 2]])
        for p, (t, _) in zip(lengths, first)
    ]
    for params in (lengths, stops):
        sync_result = run(False, params)
        assert run(True, params) == sync_result
    assert any(reason == "stop" for _, reason in sync_result)
