"""The ``llama-3.2-1b`` preset is the published Llama-3.2-1B config, and an engine config builds
from it (config only: the 1B model itself is never built on the CPU).

Run: pytest tests/models/loading/test_preset_configs.py
"""

from __future__ import annotations

from pieceworks.engine.arg_utils import build_engine_config
from pieceworks.models.layers.rotary_embedding import compute_inv_freq, get_rope_parameters
from pieceworks.models.loading.presets import get_preset

# meta-llama/Llama-3.2-1B config.json, the fields that decide the shape and the numbers.
LLAMA_3_2_1B = {
    "num_hidden_layers": 16,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 8192,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


def test_llama_3_2_1b_is_the_published_config():
    preset = get_preset("llama-3.2-1b")
    assert {key: preset[key] for key in LLAMA_3_2_1B} == LLAMA_3_2_1B
    assert preset["architectures"] == ["LlamaForCausalLM"]


def test_llama_3_2_1b_engine_config_and_rope_build():
    config = build_engine_config("llama-3.2-1b", {"backend": "eager"}, max_num_seqs=64)
    assert config.model_config.hf_config["num_hidden_layers"] == 16
    base, scaling, partial = get_rope_parameters(config.model_config.hf_config)
    assert (base, partial) == (500000.0, 1.0) and scaling is not None
    inv_freq = compute_inv_freq(base, 64, scaling)
    assert inv_freq.shape == (32,)
    # llama3 scaling divides the low frequencies by the factor and keeps the high ones
    unscaled = compute_inv_freq(base, 64, None)
    assert inv_freq[0] == unscaled[0]
    assert abs(float(inv_freq[-1] / unscaled[-1]) - 1 / 32) < 1e-6
