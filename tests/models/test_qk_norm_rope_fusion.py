"""The q/k head norms and the rotary fold into the qkv GEMV's op in Qwen3's and Gemma 3's graphs.

Tiny random Qwen3 (``rms_norm`` head norms, head_dim 32 against a hidden size of 64) and Gemma 3
(``gemma_rms_norm``'s ``1 + weight``, sliding and global layers with their own rotary caches)
checkpoints saved by transformers, with the GEMV and rotary op forms chosen on the CPU (the ops
fall back to torch inside, as in ``test_gemv_fusion.py``), at level 3 with the eager backend:
``GemvQKNormRopeFusionPass`` makes one ``small_m_qk_norm_rope_linear`` per decoder layer (the
plain rope fusion none: the norms stand between the split and the rotary), no rotary op is left,
and the greedy tokens and every step's logits equal those with ``enable_qk_norm_rope_fusion``
off and those of level 0. Tolerance: the fused op's fallback runs the torch forms the model
traces (float32), so only GEMM accumulation order may differ: 1e-5.
Run: PIECEWORKS_PLATFORM=cpu python -m pytest tests/models/test_qk_norm_rope_fusion.py -q
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.core.decorators import piecewise_backends
from pieceworks.engine.llm import LLM
from pieceworks.kernels.registry import register_kernel, unregister_kernel
from pieceworks.sampling_params import SamplingParams
from tests.models import test_gemma3_hf, test_qwen_hf
from tests.models.test_fp8 import PROMPT_LENGTHS, record_logits
from tests.models.test_gemv_fusion import split_graph_ops

FORCED_OPS = ("linear", "silu_and_mul", "gelu_and_mul", "rotary")
NUM_LAYERS = {"qwen3": 2, "gemma3": 3}


@pytest.fixture(scope="module")
def op_forms():
    """Every layer takes pieceworks' op forms on the CPU (they fall back to torch inside)."""
    for op in FORCED_OPS:
        register_kernel(op, None, name="op_form_on_cpu", platform="cpu", jitted=True)
    yield
    for op in FORCED_OPS:
        unregister_kernel(op, "op_form_on_cpu")


@pytest.fixture(scope="module", params=sorted(NUM_LAYERS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3":
        test_qwen_hf.save_hf_checkpoint(path, "Qwen3", {"head_dim": 32})
    else:  # tied, no attention bias (a qkv bias is never fused)
        test_gemma3_hf.save_hf_checkpoint(path, test_gemma3_hf.CONFIGS["softcap"])
    return str(path), request.param


def run(path: str, level: int, pass_config: dict | None = None):
    """Greedy tokens and every step's logits of three prompts; the level-3 backend, if any."""
    compilation = {"level": level, "backend": "eager", "pass_config": pass_config or {}}
    llm = LLM(path, compilation_config=compilation, dtype="float32", max_num_seqs=4,
              max_model_len=128)  # fmt: skip
    model = llm.engine.runner.model
    recorded = record_logits(model)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    backends = piecewise_backends(model)
    llm.shutdown()
    return [output.outputs[0].token_ids for output in outputs], recorded, backends


def test_head_norms_and_rotary_fold_into_the_qkv_op(op_forms, checkpoint):
    path, name = checkpoint
    num_layers = NUM_LAYERS[name]
    fused_tokens, fused_logits, (backend,) = run(path, 3)
    assert backend.num_fusions["qk_norm_rope"] == num_layers
    assert backend.num_fusions["rope"] == 0  # the norms stand between the split and the rotary
    ops = split_graph_ops(backend)
    assert ops.count("small_m_qk_norm_rope_linear") == num_layers
    assert "rotary_embedding" not in ops

    unfused_tokens, unfused_logits, (unfused,) = run(path, 3, {"enable_qk_norm_rope_fusion": False})
    assert "qk_norm_rope" not in unfused.num_fusions
    assert split_graph_ops(unfused).count("rotary_embedding") == num_layers
    eager_tokens, eager_logits, _ = run(path, 0)
    assert fused_tokens == unfused_tokens == eager_tokens
    assert len(fused_logits) == len(eager_logits) == 4  # one prefill step, three decode steps
    for fused, unfused_step, eager in zip(fused_logits, unfused_logits, eager_logits, strict=True):
        torch.testing.assert_close(fused, unfused_step, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
