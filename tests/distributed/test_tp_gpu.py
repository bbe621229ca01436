"""The all-reduce op inside a captured CUDA graph, on two GPUs with NCCL.

Proves: ``torch.ops.pieceworks.all_reduce`` (through ``tensor_model_parallel_all_reduce``)
captured with ``torch.cuda.graph`` on each rank (``cuda:rank``) replays to the sum over the ranks,
and keeps doing so after new values are written into the static input: the captured NCCL call
reads the input's address, as every captured piece does.
Run (a machine with 2 GPUs): pytest -m gpu tests/distributed/test_tp_gpu.py
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed.spawn import run_ranks

WORLD_SIZE = 2
NUM_REPLAYS = 3

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < WORLD_SIZE, reason=f"needs {WORLD_SIZE} GPUs"),
]


def capture_all_reduce(rank: int, world_size: int) -> dict[str, Any]:
    """Capture the all-reduce of a static (4, 8) input, replay it with new values each time."""
    from pieceworks.distributed import tensor_model_parallel_all_reduce

    device = torch.device("cuda", rank)
    static_input = torch.full((4, 8), float(rank + 1), device=device)
    eager = tensor_model_parallel_all_reduce(static_input)  # also creates the NCCL communicator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_output = tensor_model_parallel_all_reduce(static_input)
    replays = []
    for replay in range(NUM_REPLAYS):
        static_input.fill_(float((rank + 1) * (replay + 1)))
        graph.replay()
        torch.cuda.synchronize()
        replays.append(static_output.cpu().unique().tolist())
    return {"eager": eager.cpu().unique().tolist(), "replays": replays}


def test_all_reduce_replays_inside_a_cuda_graph(tmp_path):
    outputs = run_ranks(
        capture_all_reduce, (), tmp_path / "init", world_size=WORLD_SIZE, backend="nccl"
    )
    rank_sum = sum(rank + 1 for rank in range(WORLD_SIZE))  # 1 + 2
    for output in outputs:
        assert output["eager"] == [float(rank_sum)]
        assert output["replays"] == [[float(rank_sum * (r + 1))] for r in range(NUM_REPLAYS)]


def greedy_tokens(model: str, tp: int, dtype: str) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens of three prompts and the first step's logits, FULL_AND_PIECEWISE."""
    from pieceworks.benchmarks.modes import compilation_for_mode
    from pieceworks.engine.llm import LLM
    from pieceworks.sampling_params import SamplingParams
    from tests.models.test_fp8 import record_logits

    llm = LLM(model, compilation_config=compilation_for_mode("full_and_piecewise"),
              dtype=dtype, max_num_seqs=8, tensor_parallel_size=tp)  # fmt: skip
    recorded = record_logits(llm.engine.runner.model)
    generator = torch.Generator().manual_seed(0)
    vocab = llm.config.model_config.hf_config["vocab_size"]
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (5, 17, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    llm.shutdown()
    return tokens, recorded[0].float().cpu()


@pytest.mark.parametrize("model,dtype", [("llama-125m", "float32"), ("bamba-tiny", "float32")])
def test_tp2_full_and_piecewise_gives_the_tokens_of_tp1(model, dtype):
    """NCCL all-reduces captured in the FULL and PIECEWISE graphs of rank 0 and a spawned rank
    1: same greedy tokens as one GPU (float32, TF32 off: the ranks' sums differ from one GPU's
    only in rounding order)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    tp1_tokens, tp1_logits = greedy_tokens(model, 1, dtype)
    tp2_tokens, tp2_logits = greedy_tokens(model, 2, dtype)
    error = float((tp2_logits - tp1_logits).abs().max() / tp1_logits.abs().max())
    print(
        f"{model} {dtype} TP=2 vs TP=1: max |logit diff| / max |logit| = {error:.2e}; "
        f"tokens equal: {tp2_tokens == tp1_tokens}"
    )
    assert error < 1e-3
    assert tp2_tokens == tp1_tokens
