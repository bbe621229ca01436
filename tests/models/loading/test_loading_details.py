"""Details of loading that the end-to-end loading tests do not pin down.

Proves: the presets' base configs hold HF's field names with the values the presets document,
and overrides replace them; a size rule names its field and wants a positive integer; the GGUF
refusals (a rope scaling type, a tensor type) give their whole message; GGUF weights load with
one KV head per query head when the config gives no KV head count; NaN and infinity are counted
in float8 tensors too.
Run: pytest tests/models/loading/test_loading_details.py
"""

from __future__ import annotations

import gguf
import pytest
import torch

from pieceworks.models.loading import (
    config_checks,
    gguf_loader,
    preset_configs,
    presets,
    weight_utils,
)
from pieceworks.models.loading.config_checks import _REQUIRED, check_hf_config
from tests.models.loading.test_gguf import HF_CONFIG, write_gguf

LLAMA_BASE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}
BAMBA_BASE = {
    "architectures": ["BambaForCausalLM"],
    "model_type": "bamba",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "mlp_bias": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "torch_dtype": "bfloat16",
    "use_cache": True,
}


@pytest.mark.parametrize(
    "build, base, preset",
    [
        (preset_configs._llama_config, LLAMA_BASE, "llama-tiny"),
        (preset_configs._bamba_config, BAMBA_BASE, "bamba-tiny"),
    ],
)
def test_preset_bases_and_overrides(build, base, preset):
    assert build() == base
    assert build(rms_norm_eps=1e-6, vocab_size=7) == {**base, "rms_norm_eps": 1e-6, "vocab_size": 7}
    # A preset is its base with its sizes: the whole of it passes the config checks.
    sizes = {k: v for k, v in presets.get_preset(preset).items() if k not in base}
    assert check_hf_config(build(**sizes)) == base["architectures"][0]


def test_a_size_rule_names_its_field_and_wants_a_positive_integer():
    rule = config_checks._size("hidden_size")
    assert rule == config_checks.FieldRule(
        "hidden_size", config_checks._positive_int, "a positive integer", _REQUIRED
    )


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return dict(presets.random_hf_weights(HF_CONFIG, seed=5, dtype=torch.float32))


def test_an_unsupported_gguf_rope_scaling_type_gives_the_whole_message(tmp_path, weights):
    def yarn(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)

    path = write_gguf(tmp_path / "m.gguf", weights, extra=yarn)
    with pytest.raises(gguf_loader.GGUFMetadataError) as error:
        gguf_loader.gguf_hf_config(path)
    assert str(error.value) == (
        f"{path}: llama.rope.scaling.type='yarn' is not supported from GGUF (supported: none, "
        "linear); load the model's HF directory instead"
    )


def test_an_unsupported_gguf_tensor_type_gives_the_whole_message(tmp_path, weights):
    reader = gguf_loader.open_gguf(write_gguf(tmp_path / "q81.gguf", weights))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_v.weight")
    with pytest.raises(weight_utils.WeightLoadingError) as error:
        gguf_loader.dequantize_tensor(tensor._replace(tensor_type=gguf.GGMLQuantizationType.Q8_1))
    assert str(error.value) == (
        "GGUF tensor 'blk.0.attn_v.weight' is stored as Q8_1, which pieceworks cannot dequantize "
        "(supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants Q2_K..Q6_K and "
        "the IQ quants); re-quantize the model to one of those"
    )


def test_gguf_key_rows_unpermute_by_the_query_heads_without_a_kv_head_count(tmp_path, weights):
    config = {**HF_CONFIG, "num_key_value_heads": HF_CONFIG["num_attention_heads"]}
    mha = {name: w for name, w in presets.random_hf_weights(config, seed=6, dtype=torch.float32)}
    path = write_gguf(tmp_path / "mha.gguf", mha, hf_config=config)
    without = {k: v for k, v in config.items() if k != "num_key_value_heads"}
    loaded = dict(gguf_loader.gguf_weights_iterator(path, without))
    for name, weight in mha.items():
        assert torch.equal(loaded[name], weight), name


def test_non_finite_values_are_counted_in_float8_too():
    values = torch.tensor([1.0, float("nan"), float("inf"), -2.0, float("-inf")])
    assert weight_utils.non_finite_count(values) == 3
    assert weight_utils.non_finite_count(values.to(torch.bfloat16)) == 3
    assert weight_utils.non_finite_count(values.to(torch.float8_e5m2)) == 3


def test_random_matrices_are_drawn_at_the_configs_initializer_range():
    def spread(config: dict) -> tuple[float, float]:
        drawn = dict(presets.random_hf_weights(config, seed=5, dtype=torch.float32))
        return drawn["model.layers.0.mlp.down_proj.weight"].std().item(), drawn[
            "model.norm.weight"
        ].std().item()

    default = {k: v for k, v in HF_CONFIG.items() if k != "initializer_range"}
    assert spread(default)[0] == pytest.approx(presets.INIT_STD, rel=0.05)
    narrow_matrix, narrow_norm = spread({**HF_CONFIG, "initializer_range": 0.002})
    assert narrow_matrix == pytest.approx(0.002, rel=0.05)
    assert narrow_norm == pytest.approx(spread(default)[1])  # norms keep their own noise
