"""The ``qwen3.5-9b`` preset is the published Qwen3.5-9B text config, an engine config builds
from it, its checkpoint has about 9B parameters (counted from the config, nothing built), and the
random-weight recipe names and shapes every tensor as transformers' ``Qwen3_5ForCausalLM`` does.

Run: pytest tests/models/loading/test_qwen3_5_preset.py
"""

from __future__ import annotations

import pytest
import torch

from pieceworks.engine.arg_utils import build_engine_config
from pieceworks.models.layers.rotary_embedding import get_rope_parameters
from pieceworks.models.loading.presets import get_preset, hf_weight_specs, num_parameters

# Qwen/Qwen3.5-9B config.json's text_config: the fields that decide the shape and the numbers.
QWEN3_5_9B_TEXT = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "full_attention_interval": 4,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "vocab_size": 248320,
    "eos_token_id": 248044,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
    },
}
# The text model of the published checkpoint: 9.65B in all, less the vision tower (about 0.45B)
# and the multi-token-prediction layer (about 0.24B), leaves about 8.95B.
TEXT_PARAMETERS = 8.95e9

TINY = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "vocab_size": 256,
}


def test_qwen3_5_9b_is_the_published_text_config():
    preset = get_preset("qwen3.5-9b")
    assert {key: preset[key] for key in QWEN3_5_9B_TEXT} == QWEN3_5_9B_TEXT
    assert preset["architectures"] == ["Qwen3_5ForCausalLM"]


def test_qwen3_5_9b_engine_config_builds():
    config = build_engine_config("qwen3.5-9b", {"backend": "eager"}, max_num_seqs=64)
    hf_config = config.model_config.hf_config
    assert hf_config["layer_types"].count("full_attention") == 8
    base, _, partial = get_rope_parameters(hf_config)
    assert (base, partial) == (10000000, 0.25)


def test_qwen3_5_9b_has_about_nine_billion_parameters():
    count = num_parameters(get_preset("qwen3.5-9b"))
    assert count == pytest.approx(TEXT_PARAMETERS, rel=0.01)
    assert count == 8_953_803_264  # 1,017,118,720 of them the input embedding


def test_weight_specs_are_transformers_names_and_shapes():
    transformers = pytest.importorskip("transformers")
    fields = {key: value for key, value in TINY.items() if key != "architectures"}
    with torch.device("meta"):
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**fields))
    hf_config = {**model.config.to_dict(), "architectures": TINY["architectures"]}
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    assert {name: spec.shape for name, spec in hf_weight_specs(hf_config).items()} == expected
