"""A checkpoint error under tensor parallelism is reported once, as rank 0's own error.

Every rank loads the whole checkpoint, so a damaged tensor fails every rank the same way: on CPU
with gloo and ``tensor_parallel_size=2``, ``LLM`` raises rank 0's ``WeightLoadingError`` naming the
tensor (not a ``RuntimeError`` wrapping the worker's traceback), the worker logs one line without a
traceback, and the process can build a good engine afterwards.
Run: pytest tests/distributed/test_tp_user_errors.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.engine.llm import LLM
from pieceworks.models.loading.hf_directory import save_hf_directory
from pieceworks.models.loading.presets import get_preset, random_hf_weights
from pieceworks.models.loading.weight_utils import WeightLoadingError

NORM = "model.norm.weight"


def test_a_nan_weight_with_two_ranks_is_one_error_naming_the_tensor(tmp_path, capfd):
    hf_config = {**get_preset("llama-tiny"), "torch_dtype": "float32"}
    weights = dict(random_hf_weights(hf_config, seed=0, dtype=torch.float32))
    weights[NORM] = torch.full_like(weights[NORM], float("nan"))
    save_hf_directory(weights, hf_config, tmp_path)
    with pytest.raises(WeightLoadingError, match=f"checkpoint tensor '{NORM}' holds 64 NaN"):
        LLM(str(tmp_path), compilation_config={"level": 0}, tensor_parallel_size=2)
    err = capfd.readouterr().err
    assert "Traceback" not in err
    assert "rank 1 failed at start-up: checkpoint tensor" in err
    llm = LLM("llama-tiny", compilation_config={"level": 0}, max_num_seqs=2)
    assert len(llm.generate([[1, 2]])[0].outputs[0].token_ids) == 16
