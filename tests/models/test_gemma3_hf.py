"""Gemma 3 text logits and greedy tokens equal HF transformers' on checkpoints it saved.

Each checkpoint is a tiny random ``Gemma3ForCausalLM`` built and saved by transformers itself
(``Gemma3TextConfig``, float32, eager attention in HF), with its norms drawn at random
(transformers initialises Gemma's norms to zero, the identity scale, which would hide a dropped
norm): three layers ``sliding, sliding, full`` with a window of 8 against prompts of up to 30
tokens, distinct rotary bases per layer type, ``query_pre_attn_scalar`` unlike ``head_dim``.
``softcap``: tied, linear rope scaling on the full layers, ``gelu_pytorch_tanh``, a
``final_logit_softcapping`` small enough to bend the logits; ``untied-bias``: untied, attention
biases, the erf ``gelu``. Logits of prefill, decode, a mixed batch and a chunked prefill are
within SPEC §4's tolerance at levels 0 and 3; greedy tokens equal ``generate``'s eagerly, with
PIECEWISE and FULL_AND_PIECEWISE graphs (the simgraph platform where the resolved one has no
graphs), and under preemption by a KV cache too small for the batch. Unimplemented fields
(``attn_logit_softcapping``, ``use_bidirectional_attention``, an activation pieceworks lacks)
are refused with the field named; older config.json keys (``rope_theta``,
``rope_local_base_freq``, ``sliding_window_pattern``) are read as transformers reads them.
Run: pytest tests/models/test_gemma3_hf.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.engine.llm import LLM
from pieceworks.models.loading.config_checks import ModelConfigError, check_hf_config
from pieceworks.models.loading.config_defaults import with_architecture_defaults
from pieceworks.sampling_params import SamplingParams
from tests.models.hf_reference import greedy_tokens, hf_greedy
from tests.models.test_llama_hf import run_and_compare

transformers = pytest.importorskip("transformers")

WINDOW = 8
SHAPE = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "sliding_window": WINDOW,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 24,
}
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
CONFIGS = {
    "softcap": {
        "tie_word_embeddings": True,
        "final_logit_softcapping": 0.5,
        "rope_parameters": {
            **ROPE,
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        },
    },
    "untied-bias": {
        "tie_word_embeddings": False,
        "attention_bias": True,
        "hidden_activation": "gelu",
        "rope_parameters": {
            **ROPE,
            "full_attention": {"rope_type": "default", "rope_theta": 50000.0},
        },
    },
}


def save_hf_checkpoint(path, fields: dict, seed: int = 0) -> None:
    """A random ``Gemma3ForCausalLM`` saved by transformers, its norms drawn at random."""
    hf_config = transformers.Gemma3TextConfig(**SHAPE, **fields)
    torch.manual_seed(seed)
    hf_model = transformers.Gemma3ForCausalLM(hf_config).float().eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.3)  # the scale is 1 + weight: a dropped norm would show
            elif name.endswith("bias"):
                param.normal_(0.0, 0.5)
    hf_model.save_pretrained(path)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_hf_checkpoint(path, CONFIGS[request.param])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return str(path), hf_model, request.param


def test_the_checkpoint_is_what_the_case_names(saved):
    path, hf_model, name = saved
    assert type(hf_model).__name__ == "Gemma3ForCausalLM"
    assert hf_model.config.architectures == ["Gemma3ForCausalLM"]
    attention = hf_model.model.layers[0].self_attn
    assert (
        attention.sliding_window == WINDOW
        and hf_model.model.layers[2].self_attn.is_sliding is False
    )
    assert (attention.q_proj.bias is not None) == (name == "untied-bias")
    assert hf_model.config.final_logit_softcapping == CONFIGS[name].get("final_logit_softcapping")
    rope_types = hf_model.model.rotary_emb.rope_type
    assert rope_types["full_attention"] == ("linear" if name == "softcap" else "default")


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("level", [0, 3])
def test_prefill_decode_mixed_and_chunked_logits_match_hf(saved, level):
    path, hf_model, _ = saved
    llm = LLM(
        path,
        compilation_config={"level": level, "backend": "eager"},
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=24,
    )
    generator = torch.Generator().manual_seed(level)
    prompt = lambda n: torch.randint(0, 256, (n,), generator=generator).tolist()  # noqa: E731
    # 5 and 20 tokens (past the window of 8) prefill together, then decode; a 30-token prompt
    # arrives later and is chunked by the 24-token budget while the first two decode (mixed).
    compared = run_and_compare(
        llm, hf_model, [prompt(5), prompt(20)], steps=3, late_prompts=[prompt(30)]
    )
    assert compared == 3 * 3  # every produced token of every request was checked


PROMPTS = [[3, 17, 92, 5, 8, 111, 40, 2, 9, 77, 13, 6], list(range(30, 50))]
MAX_TOKENS = 6


def assert_greedy_tokens_equal_hf(saved, mode: str) -> None:
    path, hf_model, _ = saved
    assert greedy_tokens(path, mode, PROMPTS, MAX_TOKENS, max_num_seqs=2) == [
        hf_greedy(hf_model, prompt, MAX_TOKENS) for prompt in PROMPTS
    ]


@pytest.mark.platform_agnostic
def test_greedy_tokens_equal_hf_generate(saved):
    assert_greedy_tokens_equal_hf(saved, "eager")


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("saved", ["softcap"], indirect=True)
@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_greedy_tokens_equal_hf_generate_with_graphs(saved, mode, graph_platform):
    assert_greedy_tokens_equal_hf(saved, mode)


@pytest.mark.platform_agnostic
@pytest.mark.parametrize("saved", ["softcap"], indirect=True)
def test_greedy_tokens_equal_hf_under_preemption(saved):
    """Three requests of 3 blocks each (16 tokens a block) share 5 blocks: some are preempted
    and recomputed, and every request still ends with HF's tokens."""
    path, hf_model, _ = saved
    llm = LLM(
        path,
        compilation_config={"level": 0},
        dtype="float32",
        max_num_seqs=3,
        num_gpu_blocks_override=5,
    )
    scheduler = llm.engine.scheduler
    schedule, outputs = scheduler.schedule, []
    scheduler.schedule = lambda: outputs.append(schedule()) or outputs[-1]
    prompts = [list(range(i, i + 20)) for i in (1, 60, 120)]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    results = llm.generate(prompts, params)
    assert sum(len(output.preempted_requests) for output in outputs) > 0
    assert [out.outputs[0].token_ids for out in results] == [
        hf_greedy(hf_model, prompt, 14) for prompt in prompts
    ]


def _config(**fields) -> dict:
    hf_config = transformers.Gemma3TextConfig(**SHAPE).to_dict()
    hf_config.update(architectures=["Gemma3ForCausalLM"], **fields)
    return hf_config


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ({"hidden_activation": "silu"}, "hidden_activation='silu'"),
        (
            {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
            "layer_types",
        ),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}}, "yarn"),
    ],
)
def test_unimplemented_fields_are_refused_with_the_field_named(fields, named):
    with pytest.raises(ModelConfigError, match=named):
        check_hf_config(_config(**fields))


def test_older_config_keys_read_as_transformers_reads_them():
    """``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` and ``sliding_window_pattern``
    (config.json files written before transformers 5) give transformers' layer types and ropes."""
    older = {
        k: v
        for k, v in SHAPE.items()
        if k not in ("layer_types", "head_dim", "query_pre_attn_scalar")
    }
    older.update(
        num_hidden_layers=5,
        sliding_window_pattern=2,
        rope_theta=20000.0,
        rope_local_base_freq=500.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    reference = transformers.Gemma3TextConfig(**older)
    ours = with_architecture_defaults({**older, "architectures": ["Gemma3ForCausalLM"]})
    assert ours["layer_types"] == reference.layer_types
    assert ours["rope_parameters"] == reference.rope_parameters
    assert (ours["head_dim"], ours["query_pre_attn_scalar"]) == (256, 256)
    assert check_hf_config(ours) == "Gemma3ForCausalLM"


def test_fp8_is_refused_with_a_clear_error(saved):
    path, _, _ = saved
    with pytest.raises(ValueError, match="quantization='fp8' is implemented for"):
        LLM(path, quantization="fp8", compilation_config={"level": 0}, dtype="float32")
