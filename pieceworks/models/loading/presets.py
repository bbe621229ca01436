"""Named model shapes (HF config.json dicts) and random weights for them, without transformers.

A preset is what the benchmarks and the default job run when no checkpoint is at hand:
``get_preset("llama-3.1-8b")`` is the real model's config.json; ``random_hf_weights`` yields
random tensors under the HF names and shapes that config implies, so a model loads them through
the same ``load_weights`` path as a real checkpoint, and ``random_hf_checkpoint`` saves them as an
HF directory (which HF transformers can load too). The config dicts live in ``preset_configs.py``.
Adding an architecture means one ``*_weight_specs`` function in ``_WEIGHT_SPECS``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from pieceworks.models.loading.config_defaults import with_architecture_defaults
from pieceworks.models.loading.hf_directory import save_hf_directory
from pieceworks.models.loading.preset_configs import INIT_STD, PRESETS

NORM_NOISE_STD = 0.1  # norm weights ~ 1 + N(0, 0.1): a norm that ignored its weight would show


def preset_names() -> list[str]:
    return sorted(PRESETS)


def is_preset(name: str) -> bool:
    return name in PRESETS


def get_preset(name: str) -> dict[str, Any]:
    """A fresh copy of the preset's config.json dict; unknown names list the known ones."""
    if name not in PRESETS:
        raise ValueError(
            f"unknown model preset {name!r}; presets: {', '.join(preset_names())} "
            "(or pass a directory in HF format)"
        )
    return copy.deepcopy(PRESETS[name])


# ---------------------------------------------------------------------------------------------
# HF weight names and shapes, per architecture


class WeightSpec(NamedTuple):
    """One checkpoint tensor: its shape and how a random one is drawn (see ``_random_tensor``)."""

    shape: tuple[int, ...]
    init: str = "normal"  # "normal" | "norm" | "offset_norm" | "ones" | "a_log"


def _head_dim(config: dict[str, Any]) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def _attention_specs(config: dict[str, Any], prefix: str) -> dict[str, WeightSpec]:
    """HF ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (+ biases with ``attention_bias``)."""
    hidden, head_dim = config["hidden_size"], _head_dim(config)
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    out = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
    specs = {f"{prefix}.{name}.weight": WeightSpec((size, hidden)) for name, size in out.items()}
    specs[f"{prefix}.o_proj.weight"] = WeightSpec((hidden, q_size))
    if config["attention_bias"]:
        specs.update({f"{prefix}.{name}.bias": WeightSpec((size,)) for name, size in out.items()})
        specs[f"{prefix}.o_proj.bias"] = WeightSpec((hidden,))
    return specs


def _mlp_specs(config: dict[str, Any], prefix: str) -> dict[str, WeightSpec]:
    """HF ``gate_proj``/``up_proj``/``down_proj`` (+ biases with ``mlp_bias``)."""
    hidden, intermediate = config["hidden_size"], config["intermediate_size"]
    specs = {
        f"{prefix}.gate_proj.weight": WeightSpec((intermediate, hidden)),
        f"{prefix}.up_proj.weight": WeightSpec((intermediate, hidden)),
        f"{prefix}.down_proj.weight": WeightSpec((hidden, intermediate)),
    }
    if config["mlp_bias"]:
        specs[f"{prefix}.gate_proj.bias"] = WeightSpec((intermediate,))
        specs[f"{prefix}.up_proj.bias"] = WeightSpec((intermediate,))
        specs[f"{prefix}.down_proj.bias"] = WeightSpec((hidden,))
    return specs


def _embedding_specs(config: dict[str, Any], final_norm: str) -> dict[str, WeightSpec]:
    """Embedding, final norm and (untied) LM head."""
    vocab, hidden = config["vocab_size"], config["hidden_size"]
    specs = {
        "model.embed_tokens.weight": WeightSpec((vocab, hidden)),
        f"model.{final_norm}.weight": WeightSpec((hidden,), "norm"),
    }
    if not config["tie_word_embeddings"]:
        specs["lm_head.weight"] = WeightSpec((vocab, hidden))
    return specs


def llama_weight_specs(config: dict[str, Any]) -> dict[str, WeightSpec]:
    """Every tensor of an HF ``LlamaForCausalLM`` checkpoint."""
    hidden = config["hidden_size"]
    specs: dict[str, WeightSpec] = {}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        specs[f"{prefix}.input_layernorm.weight"] = WeightSpec((hidden,), "norm")
        specs.update(_attention_specs(config, f"{prefix}.self_attn"))
        specs[f"{prefix}.post_attention_layernorm.weight"] = WeightSpec((hidden,), "norm")
        specs.update(_mlp_specs(config, f"{prefix}.mlp"))
    return {**_embedding_specs(config, "norm"), **specs}


def qwen3_weight_specs(config: dict[str, Any]) -> dict[str, WeightSpec]:
    """Every tensor of an HF ``Qwen3ForCausalLM`` checkpoint: Llama's (no MLP bias) plus the
    per-head ``q_norm`` and ``k_norm``."""
    specs = llama_weight_specs({**config, "mlp_bias": False})
    head_dim = _head_dim(config)
    for layer in range(config["num_hidden_layers"]):
        for norm in ("q_norm", "k_norm"):
            specs[f"model.layers.{layer}.self_attn.{norm}.weight"] = WeightSpec((head_dim,), "norm")
    return specs


def gemma3_weight_specs(config: dict[str, Any]) -> dict[str, WeightSpec]:
    """Every tensor of an HF ``Gemma3ForCausalLM`` checkpoint: Qwen3's attention (with q/k
    norms) and MLP, four norms per layer, all stored as ``w`` for a ``(1 + w)`` scale."""
    specs = qwen3_weight_specs(config)
    hidden = config["hidden_size"]
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            specs[f"{prefix}.{norm}.weight"] = WeightSpec((hidden,), "norm")
    return {
        name: WeightSpec(spec.shape, "offset_norm") if spec.init == "norm" else spec
        for name, spec in specs.items()
    }


def _mamba_specs(config: dict[str, Any], prefix: str) -> dict[str, WeightSpec]:
    """HF ``BambaMixer``: in_proj -> (gate z, conv input xBC, dt), conv1d, SSM params, out_proj."""
    hidden, num_heads = config["hidden_size"], config["mamba_n_heads"]
    intermediate = config["mamba_expand"] * hidden
    conv_dim = intermediate + 2 * config["mamba_n_groups"] * config["mamba_d_state"]
    specs = {
        f"{prefix}.in_proj.weight": WeightSpec((intermediate + conv_dim + num_heads, hidden)),
        f"{prefix}.conv1d.weight": WeightSpec((conv_dim, 1, config["mamba_d_conv"])),
        f"{prefix}.dt_bias": WeightSpec((num_heads,), "ones"),
        f"{prefix}.A_log": WeightSpec((num_heads,), "a_log"),
        f"{prefix}.D": WeightSpec((num_heads,), "ones"),
        f"{prefix}.norm.weight": WeightSpec((intermediate,), "norm"),
        f"{prefix}.out_proj.weight": WeightSpec((hidden, intermediate)),
    }
    if config["mamba_conv_bias"]:
        specs[f"{prefix}.conv1d.bias"] = WeightSpec((conv_dim,))
    if config["mamba_proj_bias"]:
        specs[f"{prefix}.in_proj.bias"] = WeightSpec((intermediate + conv_dim + num_heads,))
        specs[f"{prefix}.out_proj.bias"] = WeightSpec((hidden,))
    return specs


def bamba_weight_specs(config: dict[str, Any]) -> dict[str, WeightSpec]:
    """Every tensor of an HF ``BambaForCausalLM`` checkpoint."""
    hidden = config["hidden_size"]
    attention_layers = set(config.get("attn_layer_indices") or [])
    specs: dict[str, WeightSpec] = {}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        specs[f"{prefix}.input_layernorm.weight"] = WeightSpec((hidden,), "norm")
        if layer in attention_layers:
            specs.update(_attention_specs(config, f"{prefix}.self_attn"))
        else:
            specs.update(_mamba_specs(config, f"{prefix}.mamba"))
        specs[f"{prefix}.pre_ff_layernorm.weight"] = WeightSpec((hidden,), "norm")
        specs.update(_mlp_specs(config, f"{prefix}.feed_forward"))
    return {**_embedding_specs(config, "final_layernorm"), **specs}


def _gated_delta_net_specs(config: dict[str, Any], prefix: str) -> dict[str, WeightSpec]:
    """HF ``Qwen3_5GatedDeltaNet``: four input projections, the conv over ``[q, k, v]``, the
    decay and rate parameters, the per-head gated norm and ``out_proj`` (no biases)."""
    hidden, num_v_heads = config["hidden_size"], config["linear_num_value_heads"]
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = num_v_heads * config["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    return {
        f"{prefix}.in_proj_qkv.weight": WeightSpec((conv_dim, hidden)),
        f"{prefix}.in_proj_z.weight": WeightSpec((value_dim, hidden)),
        f"{prefix}.in_proj_b.weight": WeightSpec((num_v_heads, hidden)),
        f"{prefix}.in_proj_a.weight": WeightSpec((num_v_heads, hidden)),
        f"{prefix}.conv1d.weight": WeightSpec((conv_dim, 1, config["linear_conv_kernel_dim"])),
        f"{prefix}.dt_bias": WeightSpec((num_v_heads,), "ones"),
        f"{prefix}.A_log": WeightSpec((num_v_heads,), "a_log"),
        f"{prefix}.norm.weight": WeightSpec((config["linear_value_head_dim"],), "norm"),
        f"{prefix}.out_proj.weight": WeightSpec((hidden, value_dim)),
    }


def qwen3_5_weight_specs(config: dict[str, Any]) -> dict[str, WeightSpec]:
    """Every tensor of an HF ``Qwen3_5ForCausalLM`` checkpoint: per ``layer_types``, gated
    attention (``q_proj`` twice as wide: each head's query and its gate; q/k norms) or Gated
    DeltaNet, then the MLP. Its norms compute ``x * (1 + w)`` but the gated one's ``x * w``."""
    hidden, head_dim = config["hidden_size"], _head_dim(config)
    specs: dict[str, WeightSpec] = {}
    for layer, layer_type in enumerate(config["layer_types"]):
        prefix = f"model.layers.{layer}"
        specs[f"{prefix}.input_layernorm.weight"] = WeightSpec((hidden,), "offset_norm")
        if layer_type == "full_attention":
            attention = _attention_specs(config, f"{prefix}.self_attn")
            q_size = 2 * config["num_attention_heads"] * head_dim
            attention[f"{prefix}.self_attn.q_proj.weight"] = WeightSpec((q_size, hidden))
            if config["attention_bias"]:
                attention[f"{prefix}.self_attn.q_proj.bias"] = WeightSpec((q_size,))
            for norm in ("q_norm", "k_norm"):
                attention[f"{prefix}.self_attn.{norm}.weight"] = WeightSpec(
                    (head_dim,), "offset_norm"
                )
            specs.update(attention)
        else:
            specs.update(_gated_delta_net_specs(config, f"{prefix}.linear_attn"))
        specs[f"{prefix}.post_attention_layernorm.weight"] = WeightSpec((hidden,), "offset_norm")
        specs.update(_mlp_specs({**config, "mlp_bias": False}, f"{prefix}.mlp"))
    embedding = _embedding_specs(config, "norm")
    embedding["model.norm.weight"] = WeightSpec((hidden,), "offset_norm")
    return {**embedding, **specs}


_WEIGHT_SPECS: dict[str, Callable[[dict[str, Any]], dict[str, WeightSpec]]] = {
    "LlamaForCausalLM": llama_weight_specs,
    "BambaForCausalLM": bamba_weight_specs,
    "Qwen3ForCausalLM": qwen3_weight_specs,
    "Gemma3ForCausalLM": gemma3_weight_specs,
    "Qwen3_5ForCausalLM": qwen3_5_weight_specs,
}


def hf_weight_specs(hf_config: dict[str, Any]) -> dict[str, WeightSpec]:
    """HF checkpoint names -> ``WeightSpec`` for the config's architecture."""
    architectures = hf_config.get("architectures") or []
    for architecture in architectures:
        if architecture in _WEIGHT_SPECS:
            return _WEIGHT_SPECS[architecture](with_architecture_defaults(hf_config))
    raise ValueError(
        f"no random-weight recipe for architectures {architectures}; known: "
        f"{', '.join(sorted(_WEIGHT_SPECS))}"
    )


# ---------------------------------------------------------------------------------------------
# Random weights


def _random_tensor(
    spec: WeightSpec,
    generator: torch.Generator,
    dtype: torch.dtype,
    device: torch.device | str,
    std: float,
) -> torch.Tensor:
    if spec.init == "ones":
        return torch.ones(spec.shape, dtype=dtype, device=device)
    if spec.init == "a_log":  # Mamba2's A = -exp(A_log) = -(1 .. num_heads)
        return torch.arange(1, spec.shape[0] + 1, device=device).log().to(dtype)
    noise = torch.randn(spec.shape, generator=generator, dtype=dtype, device=device)
    if spec.init == "norm":
        return noise.mul_(NORM_NOISE_STD).add_(1.0)
    if spec.init == "offset_norm":  # a norm computing x * (1 + w): w near 0
        return noise.mul_(NORM_NOISE_STD)
    if spec.init != "normal":
        raise ValueError(f"unknown WeightSpec init {spec.init!r}")
    return noise.mul_(std)


def random_hf_weights(
    hf_config: dict[str, Any],
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, random tensor)`` one at a time (only one extra tensor alive). Matrices
    are drawn from N(0, ``initializer_range``) as transformers initialises them (``INIT_STD``
    where the config has none)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    std = float(hf_config.get("initializer_range") or INIT_STD)
    for name, spec in hf_weight_specs(hf_config).items():
        yield name, _random_tensor(spec, generator, dtype, device, std)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def random_hf_checkpoint(
    name_or_config: str | dict[str, Any],
    path: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int | None = None,
) -> Path:
    """Save a random-weight HF directory for a preset name or config dict; returns ``path``."""
    hf_config = get_preset(name_or_config) if isinstance(name_or_config, str) else name_or_config
    hf_config = {**copy.deepcopy(hf_config), "torch_dtype": _dtype_name(dtype)}
    state_dict = dict(random_hf_weights(hf_config, seed=seed, dtype=dtype))
    return save_hf_directory(state_dict, hf_config, path, max_shard_bytes=max_shard_bytes)


def num_parameters(hf_config: dict[str, Any]) -> int:
    """Parameter count of the checkpoint the config describes (tied weights counted once)."""
    return sum(math.prod(spec.shape) for spec in hf_weight_specs(hf_config).values())
