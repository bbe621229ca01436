"""Gemma 3's GeGLU fused into the gate/up GEMV: the pass on the traced model, the same tokens.

A tiny random Gemma 3 (hidden 64, 2 layers, one sliding and one global, vocab 256), float32, with
the decode GEMV ops and the ``gelu_and_mul`` op form chosen (on the CPU through implementations
registered for the ``cpu`` platform, so every op runs its torch fallback inside), at level 3
(eager backend): the gate/up fusion makes one ``small_m_gelu_and_mul_linear`` per decoder layer
and no ``gelu_and_mul`` is left in the split graph; with the fusion off the graph keeps one
``gelu_and_mul`` per layer. The greedy tokens and every step's logits equal those of the unfused
compiled model and of level 0 (which runs the plain ops). Tolerance 1e-5: the fused op's fallback
runs the same float32 torch arithmetic as the plain ops; only GEMM accumulation order may differ.
Run: PYTHONPATH=. PIECEWORKS_PLATFORM=cpu python -m pytest tests/models/test_gemma3_gemv_fusion.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.core.decorators import piecewise_backends
from pieceworks.engine.llm import LLM
from pieceworks.kernels.registry import register_kernel, unregister_kernel
from pieceworks.models.loading import presets
from pieceworks.models.loading.preset_configs import _gemma3_config
from pieceworks.sampling_params import SamplingParams
from tests.models.test_fp8 import PROMPT_LENGTHS, record_logits
from tests.models.test_gemv_fusion import split_graph_ops

NUM_LAYERS = 2
MODEL = "gemma3-tiny-gemv-fusion"  # a preset this module adds for its runs
TINY_GEMMA3 = _gemma3_config(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=24,
    max_position_embeddings=256,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    tie_word_embeddings=True,
)
FORCED_OPS = ("linear", "gelu_and_mul", "rotary")


@pytest.fixture(scope="module")
def runs():
    """The tiny Gemma 3 as a preset and pieceworks' op forms on the CPU (torch inside), then
    ``(fused, unfused, eager)``, each ``(tokens, logits, backends)``."""
    presets.PRESETS[MODEL] = TINY_GEMMA3
    for op in FORCED_OPS:
        register_kernel(op, None, name="op_form_on_cpu", platform="cpu", jitted=True)
    try:
        yield (
            run(3),
            run(3, {"enable_gemv_act_fusion": False}),
            run(0),
        )
    finally:
        for op in FORCED_OPS:
            unregister_kernel(op, "op_form_on_cpu")
        del presets.PRESETS[MODEL]


def run(level: int, pass_config: dict | None = None):
    """Greedy tokens and every step's logits of three prompts; the level-3 backend, if any."""
    compilation = {"level": level, "backend": "eager", "pass_config": pass_config or {}}
    llm = LLM(MODEL, compilation_config=compilation, dtype="float32", max_num_seqs=4,
              max_model_len=128)  # fmt: skip
    model = llm.engine.runner.model
    recorded = record_logits(model)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    backends = piecewise_backends(model)
    llm.shutdown()
    return [output.outputs[0].token_ids for output in outputs], recorded, backends


def test_the_pass_fuses_every_layer_s_gelu_and_mul_into_its_gate_up_gemv(runs):
    (_, _, (fused,)), (_, _, (unfused,)), _ = runs
    assert fused.num_fusions["gemv_act"] == NUM_LAYERS
    ops = split_graph_ops(fused)
    assert ops.count("small_m_gelu_and_mul_linear") == NUM_LAYERS
    assert "gelu_and_mul" not in ops
    assert "gemv_act" not in unfused.num_fusions  # switched off
    unfused_ops = split_graph_ops(unfused)
    assert unfused_ops.count("gelu_and_mul") == NUM_LAYERS
    assert "small_m_gelu_and_mul_linear" not in unfused_ops


def test_fused_tokens_and_logits_equal_unfused_and_eager(runs):
    (fused_tokens, fused_logits, _), (unfused_tokens, unfused_logits, _), eager = runs
    eager_tokens, eager_logits, _ = eager
    assert fused_tokens == unfused_tokens == eager_tokens
    assert len(fused_logits) == len(eager_logits) == 4  # one prefill step, three decode steps
    for fused, unfused, plain in zip(fused_logits, unfused_logits, eager_logits, strict=True):
        torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
