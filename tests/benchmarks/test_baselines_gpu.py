"""On a GPU, the ``static_compiled`` peer is what a capable PyTorch user gets: within 10 % of the
independent gpt-fast-style loop (``gpt_fast``), in the same process, on a mid-size grouped-query
Llama shape at a batch and context where copying K/V out to every query head (HF's ``repeat_kv``
under a mask) would show. Both loops compile with Inductor (reduce-overhead: CUDA graphs).

Run on a GPU machine: pytest -m gpu tests/benchmarks/test_baselines_gpu.py
"""

from __future__ import annotations

import pytest

from pieceworks.benchmarks.latency import LatencyCase
from pieceworks.models.loading.presets import get_preset, random_hf_checkpoint

pytest.importorskip("transformers")

from pieceworks.benchmarks.peers.gpt_fast import measure_gpt_fast  # noqa: E402
from pieceworks.benchmarks.peers.static_compiled import measure_static_cache_compiled  # noqa: E402

MID_LLAMA = {
    **get_preset("llama-3.1-8b"),
    "hidden_size": 2048,
    "intermediate_size": 7168,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,  # 4 query heads per KV head, as at 8B
    "head_dim": 128,
    "vocab_size": 32000,
}


@pytest.mark.gpu
@pytest.mark.inductor
@pytest.mark.parametrize("batch_size", [1, 32])
def test_static_compiled_runs_within_ten_percent_of_the_independent_loop(tmp_path, batch_size):
    import torch

    random_hf_checkpoint(MID_LLAMA, tmp_path, seed=0, dtype=torch.bfloat16)
    case = LatencyCase(str(tmp_path), batch_size, 1024, 32, 1, 3, {"dtype": "bfloat16"})
    static = measure_static_cache_compiled(case)
    independent = measure_gpt_fast(case)
    ratio = static["decode_step_ms"]["median"] / independent["decode_step_ms"]["median"]
    assert ratio <= 1.10, (
        f"static_compiled {static['decode_step_ms']['median']:.3f} ms/step vs gpt_fast "
        f"{independent['decode_step_ms']['median']:.3f} ms/step at batch {batch_size}"
    )
