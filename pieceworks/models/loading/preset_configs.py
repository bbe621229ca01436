"""The named model shapes: config.json dicts of real models and of tiny test models.

``presets.py`` serves them (``get_preset``) and draws random weights for them; this module holds
only the dicts, one builder per architecture filling the fields its config.json always carries.
"""

from __future__ import annotations

from typing import Any

INIT_STD = 0.02  # weights ~ N(0, 0.02): logits of a random model stay O(1)


def _llama_config(**overrides: Any) -> dict[str, Any]:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "initializer_range": INIT_STD,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }
    config.update(overrides)
    return config


def _qwen3_config(**overrides: Any) -> dict[str, Any]:
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": INIT_STD,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }
    config.update(overrides)
    return config


def _gemma3_config(**overrides: Any) -> dict[str, Any]:
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "initializer_range": INIT_STD,
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }
    config.update(overrides)
    return config


def _bamba_config(**overrides: Any) -> dict[str, Any]:
    config = {
        "architectures": ["BambaForCausalLM"],
        "model_type": "bamba",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "hidden_act": "silu",
        "initializer_range": INIT_STD,
        "mamba_chunk_size": 256,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,  # Bamba rotates half of each head (attn_rotary_emb = 64)
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }
    config.update(overrides)
    return config


def _qwen3_5_config(**overrides: Any) -> dict[str, Any]:
    config = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "initializer_range": INIT_STD,
        "rms_norm_eps": 1e-6,
        "linear_conv_kernel_dim": 4,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }
    config.update(overrides)
    return config


PRESETS: dict[str, dict[str, Any]] = {
    # Two layers of everything, for tests: GQA (4 query heads, 2 kv heads) and tied embeddings.
    "llama-tiny": _llama_config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    # The GPT-3/OPT-125M shape as a Llama (the seed's benchmark model).
    "llama-125m": _llama_config(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        head_dim=64,
        vocab_size=50272,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    # SmolLM2-135M-Instruct's shape (the trained model is ``smollm2-135m``, see
    # models/loading/sources.py): the GPU benchmarks' model, as the GGUF file is not carried to
    # the GPU machine.
    "smollm2-135m-random": _llama_config(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # meta-llama/Llama-3.1-8B config.json.
    "llama-3.1-8b": _llama_config(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
        rope_theta=500000.0,
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        tie_word_embeddings=False,
    ),
    # meta-llama/Llama-3.2-1B config.json: the small-model decode benchmarks' largest shape.
    "llama-3.2-1b": _llama_config(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_id=128001,
        rope_theta=500000.0,
        rope_scaling={
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        tie_word_embeddings=True,
    ),
    # Qwen/Qwen3-8B config.json.
    "qwen3-8b": _qwen3_config(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        max_window_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        bos_token_id=151643,
        eos_token_id=151645,
        tie_word_embeddings=False,
    ),
    # google/gemma-3-4b-it's text_config, as a text-only Gemma3ForCausalLM: every sixth layer
    # global (rope base 1e6, linear scaling 8), the rest a 1,024-token window (base 1e4).
    "gemma-3-4b": _gemma3_config(
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=34,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=1024,
        layer_types=[
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(34)
        ],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        vocab_size=262208,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
    ),
    # Four layers, attention at layer 2, the rest Mamba2, for tests.
    "bamba-tiny": _bamba_config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        attn_layer_indices=[2],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=32,
        vocab_size=256,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    ),
    # ibm-ai-platform/Bamba-9B shape (from the issue and HF BambaConfig; checked against the
    # transformers class, not against the hub's config.json, which could not be fetched here).
    "bamba-9b": _bamba_config(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        attn_layer_indices=[9, 18, 27],
        num_attention_heads=32,
        num_key_value_heads=8,
        mamba_n_heads=128,
        mamba_d_head=64,
        mamba_d_state=128,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        vocab_size=128256,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    # Qwen/Qwen3.5-9B's text_config as a text-only Qwen3_5ForCausalLM: 32 layers, every fourth
    # full attention (16 query heads with an output gate, 4 KV heads of 256, a quarter of each
    # head rotated), the rest Gated DeltaNet (16 key heads, 32 value heads of 128). The vision
    # tower and the multi-token-prediction layer are left out (docs/models.md).
    "qwen3.5-9b": _qwen3_5_config(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        full_attention_interval=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
        },
        vocab_size=248320,
        max_position_embeddings=262144,
        eos_token_id=248044,
        tie_word_embeddings=False,
    ),
}
