"""Config fields pieceworks does not implement are refused; damaged weights are refused at load.

Proves: every preset and HF transformers' default ``LlamaConfig`` / ``BambaConfig`` /
``Qwen2Config`` / ``Qwen3Config`` / ``MistralConfig`` pass the check; Qwen's absent fields take
their config class's defaults and the bias fields transformers' Qwen does not read are ignored;
each refused field (activation, rope types, partial rotary on Llama, sliding windows, logit
scaling and soft-capping, quantized checkpoints, missing or mis-typed sizes) raises naming the
field, its value and what is supported, through ``LLM`` before anything is built; accepted
fields (biases, linear rope, ``pretraining_tp``, a non-default eps) give HF's logits; a
tensor-parallel size the heads cannot be split over is refused before any rank starts; a weight
with NaN or infinity, or of an integer or bool dtype, is a ``WeightLoadingError`` naming the
tensor (the q, k and v tensors of a merged qkv parameter); ``non_finite_count`` is exact
(float8 included).
Run: pytest tests/models/loading/test_config_checks.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.engine.llm import LLM
from pieceworks.models.loading.config_checks import (
    ModelConfigError,
    check_hf_config,
    check_tensor_parallel,
    with_architecture_defaults,
)
from pieceworks.models.loading.hf_directory import save_hf_directory
from pieceworks.models.loading.presets import get_preset, preset_names, random_hf_weights
from pieceworks.models.loading.weight_utils import WeightLoadingError, non_finite_count
from pieceworks.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

LLAMA = get_preset("llama-tiny")
BAMBA = get_preset("bamba-tiny")


@pytest.mark.parametrize("name", preset_names())
def test_presets_pass(name):
    assert check_hf_config(get_preset(name)) == get_preset(name)["architectures"][0]


@pytest.mark.parametrize(
    ("config_cls", "architecture"),
    [
        ("LlamaConfig", "LlamaForCausalLM"),
        ("BambaConfig", "BambaForCausalLM"),
        ("Qwen2Config", "Qwen2ForCausalLM"),
        ("Qwen3Config", "Qwen3ForCausalLM"),
        ("Gemma3TextConfig", "Gemma3ForCausalLM"),
        ("MistralConfig", "MistralForCausalLM"),
    ],
)
def test_hf_default_configs_pass(config_cls, architecture):
    hf_config = getattr(transformers, config_cls)().to_dict()
    hf_config["architectures"] = [architecture]
    assert check_hf_config(hf_config) == architecture


def _qwen(architecture: str, **fields) -> dict:
    drop = ("architectures", "model_type", "head_dim", "num_key_value_heads")
    return {
        **{k: v for k, v in LLAMA.items() if k not in drop},
        "architectures": [architecture],
        **fields,
    }


def test_qwen_absent_fields_take_the_config_class_defaults():
    # transformers' Qwen2Config / Qwen3Config: 32 KV heads, 32768 positions, Qwen3 head_dim 128
    qwen3 = with_architecture_defaults(_qwen("Qwen3ForCausalLM"))
    assert (qwen3["head_dim"], qwen3["num_key_value_heads"]) == (128, 32)
    assert qwen3["max_position_embeddings"] == LLAMA["max_position_embeddings"]  # present: kept
    qwen2 = with_architecture_defaults(_qwen("Qwen2ForCausalLM"))
    assert "head_dim" not in qwen2 and qwen2["num_key_value_heads"] == 32
    llama = {k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}
    assert with_architecture_defaults(llama) is llama  # Llama's absent fields read as before
    # 4 query heads cannot share 32 KV heads: refused, as HF's would fail
    with pytest.raises(ModelConfigError, match="num_key_value_heads=32 must divide"):
        check_hf_config(_qwen("Qwen2ForCausalLM", num_attention_heads=4))


def test_qwen_bias_fields_transformers_does_not_read_are_ignored():
    # HF's Qwen2 always has q/k/v biases and reads neither field; Qwen3's MLP has no bias
    qwen2 = _qwen("Qwen2ForCausalLM", num_key_value_heads=2, attention_bias="x", mlp_bias=True)
    assert check_hf_config(qwen2) == "Qwen2ForCausalLM"
    qwen3 = _qwen("Qwen3ForCausalLM", head_dim=16, num_key_value_heads=2, mlp_bias=True)
    assert check_hf_config(qwen3) == "Qwen3ForCausalLM"
    with pytest.raises(ModelConfigError, match="attention_bias='x'"):
        check_hf_config({**qwen3, "attention_bias": "x"})


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}

REFUSED = [
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act='gelu_pytorch_tanh' is not supported"),
    ({"hidden_act": "relu"}, "supported: 'silu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "supported: default, linear, llama3"),
    ({"rope_scaling": LLAMA3_ROPE}, "'llama3' needs high_freq_factor"),
    ({"rope_parameters": {"rope_type": "longrope"}}, "rope type 'longrope'"),
    ({"rope_theta": -1.0}, "rope_theta=-1.0 must be a positive number"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
    ({"sliding_window": 4096}, "sliding_window=4096 is not supported"),
    ({"use_sliding_window": True}, "use_sliding_window=True"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({"logit_scale": 0.5}, "logit_scale=0.5"),
    ({"logits_scaling": 8.0}, "logits_scaling=8.0"),
    ({"embedding_multiplier": 12.0}, "embedding_multiplier=12.0"),
    ({"residual_multiplier": 0.22}, "residual_multiplier=0.22"),
    ({"attention_multiplier": 0.01}, "attention_multiplier=0.01"),
    ({"query_pre_attn_scalar": 256}, "query_pre_attn_scalar=256"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config="),
    ({"attention_bias": "yes"}, "attention_bias='yes'"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps=-1e-05"),
    ({"hidden_size": 64.0}, "hidden_size=64.0 is not supported"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3 must divide num_attention_heads=4"),
    ({"torch_dtype": "int8"}, "torch_dtype='int8'"),
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures=['GPT2LMHeadModel']"),
]


@pytest.mark.parametrize(("overrides", "message"), REFUSED)
def test_refused_llama_fields_name_field_value_and_supported(overrides, message):
    with pytest.raises(ModelConfigError) as error:
        check_hf_config({**LLAMA, **overrides}, source="m/config.json")
    assert str(error.value).startswith("m/config.json")
    assert message in str(error.value)


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_hidden_layers"])
def test_a_missing_size_is_named(field):
    hf_config = {k: v for k, v in LLAMA.items() if k != field}
    with pytest.raises(ModelConfigError, match=f"m/config.json lacks '{field}'"):
        check_hf_config(hf_config, source="m/config.json")


def test_implemented_fields_pass():
    accepted = {
        "rope_scaling": {**LLAMA3_ROPE, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
        "attention_bias": True,
        "mlp_bias": True,
        "pretraining_tp": 2,
        "sliding_window": None,
        "logit_scale": 1.0,
        "tie_word_embeddings": False,
    }  # fmt: skip
    assert check_hf_config({**LLAMA, **accepted}) == "LlamaForCausalLM"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attn_layer_indices": [9]}, "attn_layer_indices [9] are outside the 4 layers"),
        ({"mamba_n_groups": 3}, "mamba_n_groups=3 must divide mamba_n_heads"),
        ({"mamba_d_head": "big"}, "mamba_d_head='big'"),
        ({"time_step_limit": [1.0, 0.0]}, "time_step_limit=[1.0, 0.0]"),
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor=1.5"),
    ],
)
def test_refused_bamba_fields(overrides, message):
    with pytest.raises(ModelConfigError, match=message.replace("[", r"\[")):
        check_hf_config({**BAMBA, **overrides})


def test_bamba_accepts_partial_rotary_and_time_step_limit():
    rope = {"rope_type": "default", "partial_rotary_factor": 0.25}  # where transformers reads it
    hf_config = {**BAMBA, "rope_parameters": rope, "time_step_limit": [0.0, float("inf")]}
    del hf_config["partial_rotary_factor"]
    assert check_hf_config(hf_config) == "BambaForCausalLM"


def test_tensor_parallel_split_is_checked_before_ranks_start():
    check_tensor_parallel(LLAMA, 2, "preset")  # 4 heads, 2 KV heads, 128 MLP columns
    with pytest.raises(ModelConfigError, match="num_attention_heads=4 is not divisible by"):
        check_tensor_parallel(LLAMA, 3, "preset")
    hybrid = {**BAMBA, "num_attention_heads": 6, "num_key_value_heads": 6}
    with pytest.raises(ModelConfigError, match="mamba_n_heads=8 is not divisible"):
        check_tensor_parallel({**hybrid, "intermediate_size": 96, "mamba_n_heads": 8}, 3, "preset")


def _saved(tmp_path, hf_config, edit=None):
    weights = dict(random_hf_weights(hf_config, seed=0, dtype=torch.float32))
    if edit is not None:
        edit(weights)
    save_hf_directory(weights, {**hf_config, "torch_dtype": "float32"}, tmp_path)
    return str(tmp_path)


def test_llm_refuses_an_unimplemented_activation_before_building(tmp_path, monkeypatch):
    path = _saved(tmp_path, {**LLAMA, "hidden_act": "gelu_pytorch_tanh"})
    monkeypatch.setattr("pieceworks.engine.llm.EngineCore", None)  # building would fail loudly
    with pytest.raises(ModelConfigError, match=r"config.json: hidden_act='gelu_pytorch_tanh'"):
        LLM(path, compilation_config={"level": 0})


def _set(name, value):
    def edit(weights):
        weights[name] = value(weights[name])

    return edit


NORM = "model.layers.0.input_layernorm.weight"
DAMAGED = [
    (_set(NORM, lambda w: w.index_fill(0, torch.tensor([3]), float("nan"))), "holds 1 NaN"),
    (_set(NORM, lambda w: w.index_fill(0, torch.tensor([0, 5]), float("inf"))), "holds 2 NaN"),
    (_set(NORM, lambda w: w.to(torch.int32)), "has dtype int32, not a floating-point dtype"),
    (_set(NORM, lambda w: w > 0), "has dtype bool, not a floating-point dtype"),
]


def test_a_nan_in_a_merged_parameter_names_its_checkpoint_tensors(tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    path = _saved(tmp_path, LLAMA, _set(name, lambda w: w.index_fill(1, torch.tensor([2]), 1e999)))
    prefix = "model.layers.1.self_attn"
    with pytest.raises(WeightLoadingError) as error:
        LLM(path, compilation_config={"level": 0}, dtype="float32")
    assert (
        f"checkpoint tensor '{prefix}.q_proj.weight', '{prefix}.k_proj.weight', "
        f"'{prefix}.v_proj.weight' (loaded into '{prefix}.qkv_proj.weight') holds 32 NaN or "
        "infinite value(s)"
    ) in str(error.value)


@pytest.mark.parametrize(("edit", "message"), DAMAGED)
def test_damaged_weights_are_refused_naming_the_tensor(tmp_path, edit, message):
    path = _saved(tmp_path, LLAMA, edit)
    with pytest.raises(WeightLoadingError) as error:
        LLM(path, compilation_config={"level": 0}, dtype="float32")
    assert f"checkpoint tensor '{NORM}'" in str(error.value)
    assert message in str(error.value)


def test_the_same_checkpoint_undamaged_loads_and_serves(tmp_path):
    llm = LLM(_saved(tmp_path, LLAMA), compilation_config={"level": 0}, dtype="float32")
    # ignore_eos: a random model may sample its EOS id early under the default sampling
    (result,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=16, ignore_eos=True))
    assert len(result.outputs[0].token_ids) == 16


def test_non_finite_count_is_exact():
    values = torch.tensor([1.0, float("nan"), float("-inf"), 2.0])
    assert non_finite_count(values) == 2
    assert non_finite_count(torch.full((3,), 3e38)) == 0  # large but finite
    assert non_finite_count(torch.zeros(0)) == 0
    assert non_finite_count(values.to(torch.bfloat16)) == 2
    fp8 = torch.tensor([1.0, float("nan"), 2.0]).to(torch.float8_e5m2)
    assert non_finite_count(fp8) == 1


def test_accepted_fields_give_hf_logits(tmp_path):
    """Biases on attention and MLP, linear rope scaling, pretraining_tp and a non-default eps:
    accepted because implemented, so the logits are HF's."""
    from tests.models.test_llama_hf import run_and_compare

    fields = {k: v for k, v in LLAMA.items() if k not in ("architectures", "model_type")}
    fields.update(
        attention_bias=True,
        mlp_bias=True,
        pretraining_tp=2,
        rms_norm_eps=1e-3,
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    hf_config = transformers.LlamaConfig(**fields)
    hf_config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)  # HF initialises biases to zero, which would hide them
    hf_model.save_pretrained(tmp_path)
    assert hf_model.model.rotary_emb.rope_type == "linear"
    llm = LLM(str(tmp_path), compilation_config={"level": 0}, dtype="float32", max_num_seqs=2)
    assert run_and_compare(llm, hf_model, [[1, 2, 3, 4], [5, 6, 7]], steps=3) == 2 * 3
