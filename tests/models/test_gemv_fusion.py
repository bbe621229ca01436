"""The epilogue fusions are passes: llama-tiny's plain layers, fused in its compiled graph.

With the decode GEMV ops and the activation and rotary op forms chosen (on the CPU through
implementations registered for the ``cpu`` platform, so every op takes its torch fallback inside),
llama-tiny at level 3 (eager backend) and its FP8 variant: the passes make exactly one fused
gate/up GEMV and one fused qkv GEMV per decoder layer (``2`` layers), and for FP8 one attention
writing FP8 for ``o_proj`` per layer (its op given ``o_proj``'s input scale); no activation or
rotary op is left in the split graph; the greedy tokens and every step's logits equal those of
the same model compiled with the fusions off and of level 0 (which runs the plain ops).
``custom_ops`` picks each layer's op or torch form, and so which fusions match. Tolerances: the
fused ops' fallbacks run the same torch arithmetic as the plain ops (float32), so only GEMM
accumulation order may differ: 1e-5.
Run: PYTHONPATH=. PIECEWORKS_PLATFORM=cpu python -m pytest tests/models/test_gemv_fusion.py -q
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.core.decorators import piecewise_backends
from pieceworks.core.passes.gemv_fusion import op_name
from pieceworks.engine.llm import LLM
from pieceworks.kernels.registry import register_kernel, unregister_kernel
from pieceworks.sampling_params import SamplingParams
from tests.models.test_fp8 import PROMPT_LENGTHS, record_logits

NUM_LAYERS = 2  # llama-tiny
FORCED_OPS = ("linear", "fp8_linear", "silu_and_mul", "rotary")
FUSIONS_OFF = {
    "enable_gemv_act_fusion": False,
    "enable_rope_fusion": False,
    "enable_qk_norm_rope_fusion": False,
    "enable_attn_quant_fusion": False,
}


@pytest.fixture
def op_forms():
    """Every layer takes pieceworks' op forms on the CPU (they fall back to torch inside)."""
    for op in FORCED_OPS:
        register_kernel(op, None, name="op_form_on_cpu", platform="cpu", jitted=True)
    yield
    for op in FORCED_OPS:
        unregister_kernel(op, "op_form_on_cpu")


def run(quantization: str | None, level: int, pass_config: dict | None = None, custom_ops=()):
    """Greedy tokens and every step's logits of three prompts; the level-3 backend, if any."""
    compilation = {"level": level, "backend": "eager", "pass_config": pass_config or {},
                   "custom_ops": list(custom_ops)}  # fmt: skip
    llm = LLM("llama-tiny", compilation_config=compilation, dtype="float32", max_num_seqs=4,
              quantization=quantization, max_model_len=128)  # fmt: skip
    model = llm.engine.runner.model
    recorded = record_logits(model)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    backends = piecewise_backends(model)
    llm.shutdown()
    return [output.outputs[0].token_ids for output in outputs], recorded, backends


def split_graph_ops(backend) -> list[str]:
    """The pieceworks ops left in the split graph (pieces' own graphs included)."""
    names = []
    for module in backend.split_gm.modules():
        graph = getattr(module, "graph", None)
        if isinstance(graph, torch.fx.Graph):
            names += [name for node in graph.nodes if (name := op_name(node)) is not None]
    return names


def attention_scales(backend) -> list:
    """The ``output_scale`` arguments of the attention ops in the split graph."""
    scales = []
    for module in backend.split_gm.modules():
        graph = getattr(module, "graph", None)
        if isinstance(graph, torch.fx.Graph):
            for node in graph.nodes:
                if op_name(node) == "unified_attention_with_output":
                    scale = node.kwargs.get("output_scale")
                    scales += [scale] if scale is not None else []
    return scales


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_fusions_replace_every_match_and_keep_tokens_and_logits(op_forms, quantization):
    fused_tokens, fused_logits, (backend,) = run(quantization, 3)
    attn_quant = NUM_LAYERS if quantization else 0  # attention writes FP8 for an FP8 o_proj
    assert backend.num_fusions == {
        "gemv_act": NUM_LAYERS,
        "rope": NUM_LAYERS,
        "qk_norm_rope": 0,  # llama has no head norms
        "attn_quant": attn_quant,
    }
    assert len(attention_scales(backend)) == attn_quant  # the op got o_proj's input_scale
    ops = split_graph_ops(backend)
    prefix = "small_m_fp8_" if quantization else "small_m_"
    gated = f"{prefix}silu_and_mul" + ("" if quantization else "_linear")
    assert ops.count(gated) == NUM_LAYERS
    assert ops.count(f"{prefix}rope_linear") == NUM_LAYERS
    assert ops.count(f"{prefix}linear") == 2 * NUM_LAYERS  # o_proj and down_proj stay plain
    assert "silu_and_mul" not in ops and "rotary_embedding" not in ops

    unfused_tokens, unfused_logits, (unfused,) = run(quantization, 3, FUSIONS_OFF)
    assert unfused.num_fusions == {}  # all switched off
    assert attention_scales(unfused) == []
    assert split_graph_ops(unfused).count("silu_and_mul") == NUM_LAYERS
    eager_tokens, eager_logits, _ = run(quantization, 0)
    assert fused_tokens == unfused_tokens == eager_tokens
    assert len(fused_logits) == len(eager_logits) == 4  # one prefill step, three decode steps
    for fused, unfused_step, eager in zip(fused_logits, unfused_logits, eager_logits, strict=True):
        torch.testing.assert_close(fused, unfused_step, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "custom_ops,fusions",
    [
        (
            ["-silu_and_mul"],
            {"gemv_act": 0, "rope": NUM_LAYERS, "qk_norm_rope": 0, "attn_quant": 0},
        ),
        (["-rotary"], {"gemv_act": NUM_LAYERS, "rope": 0, "qk_norm_rope": 0, "attn_quant": 0}),
        (
            ["none", "+linear", "+silu_and_mul"],
            {"gemv_act": NUM_LAYERS, "rope": 0, "qk_norm_rope": 0, "attn_quant": 0},
        ),
    ],
)
def test_custom_ops_pick_the_op_or_the_torch_form_and_so_the_fusions(op_forms, custom_ops, fusions):
    """vLLM's meaning: ``-op`` gives that layer its torch form (plain ATen, which no fusion pass
    matches), ``none`` every op but those named with ``+``; the tokens do not change."""
    tokens, _, (backend,) = run(None, 3, custom_ops=custom_ops)
    assert backend.num_fusions == fusions
    ops = split_graph_ops(backend)
    assert "silu_and_mul" not in ops and "rotary_embedding" not in ops  # fused, or never an op
    eager_tokens, _, _ = run(None, 0)
    assert tokens == eager_tokens


def test_without_the_op_forms_nothing_matches():
    """The CPU's own choices (torch forms): the graph holds no GEMV op, the passes find nothing."""
    _, _, (backend,) = run(None, 3)
    assert backend.num_fusions == {"gemv_act": 0, "rope": 0, "qk_norm_rope": 0, "attn_quant": 0}
    assert set(split_graph_ops(backend)) == {"unified_attention_with_output"}
