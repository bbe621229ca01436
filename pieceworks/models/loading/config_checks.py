"""Which config.json fields each architecture implements, and the check that refuses the rest.

A field that changes the computation is either implemented (and its value checked) or refused with
the field, its value and the supported values, before anything is built or compiled: a config
that pieceworks would run differently from HF transformers must fail, never load and give other
logits. Each architecture has one table of ``FieldRule``s (``ARCHITECTURE_RULES``); fields the
computation does not depend on (token ids, ``use_cache``, ``initializer_range``, training-only
losses, output flags) are not listed and pass. ``docs/models.md`` lists the decisions.
``check_hf_config`` is called by the engine when it builds the model config; this module reads no
files and builds nothing.
"""

from __future__ import annotations

import math
from typing import Any

from pieceworks.models.layers.activation import HF_GELU_APPROXIMATE
from pieceworks.models.layers.linear import divide, shard_or_replicate
from pieceworks.models.layers.rotary_embedding import SUPPORTED_ROPE_TYPES, get_rope_parameters
from pieceworks.models.loading.config_defaults import with_architecture_defaults
from pieceworks.models.loading.field_rules import REQUIRED as _REQUIRED
from pieceworks.models.loading.field_rules import FieldRule, ModelConfigError
from pieceworks.models.loading.field_rules import is_bool as _is_bool
from pieceworks.models.loading.field_rules import is_int as _is_int
from pieceworks.models.loading.field_rules import is_number as _is_number
from pieceworks.models.loading.field_rules import neutral as _neutral
from pieceworks.models.loading.field_rules import non_negative_number as _non_negative_number
from pieceworks.models.loading.field_rules import one_of as _one_of
from pieceworks.models.loading.field_rules import positive_int as _positive_int
from pieceworks.models.loading.field_rules import size as _size
from pieceworks.models.loading.hybrid_rules import (
    NEMOTRON_H_DROPPED,
    NEMOTRON_H_FIELDS,
    QWEN3_5_DROPPED,
    QWEN3_5_FIELDS,
    check_nemotron_h_layers,
    check_qwen3_5_layers,
)
from pieceworks.models.registry import supported_architectures

__all__ = ["FieldRule", "ModelConfigError", "check_hf_config", "check_tensor_parallel"]

_DTYPE_NAMES = ("float32", "float", "bfloat16", "float16", "half")

# Fields every supported architecture reads the same way.
COMMON_RULES = [
    _size("vocab_size"),
    _size("hidden_size"),
    _size("intermediate_size"),
    _size("num_hidden_layers"),
    _size("num_attention_heads"),
    FieldRule("num_key_value_heads", _positive_int, "a positive integer dividing the heads"),
    FieldRule("head_dim", _positive_int, "a positive integer (absent: hidden_size / heads)"),
    FieldRule("hidden_act", _one_of("silu"), "'silu' (the MLP is silu(gate) * up)", "silu"),
    FieldRule("attention_bias", _is_bool, "true or false (biases on q, k, v and o)", False),
    FieldRule("mlp_bias", _is_bool, "true or false (biases on gate, up and down)", False),
    FieldRule("rms_norm_eps", _non_negative_number, "a finite number >= 0", 1e-6),
    FieldRule("max_position_embeddings", _positive_int, "a positive integer", 2048),
    FieldRule("tie_word_embeddings", _is_bool, "true or false", False),
    FieldRule("attention_dropout", _non_negative_number, "a number (no dropout at inference)", 0),
    FieldRule("torch_dtype", _neutral(*_DTYPE_NAMES), ", ".join(_DTYPE_NAMES)),
    FieldRule("dtype", _neutral(*_DTYPE_NAMES), ", ".join(_DTYPE_NAMES)),
    # Features of other architectures that a Llama-shaped config may carry: refused unless off.
    FieldRule("sliding_window", _neutral(), "null (pieceworks attends to the whole context)"),
    FieldRule("use_sliding_window", _neutral(False), "false (full attention only)"),
    FieldRule("final_logit_softcapping", _neutral(), "null (no logit soft-capping)"),
    FieldRule("attn_logit_softcapping", _neutral(), "null (no attention soft-capping)"),
    FieldRule("logit_scale", _neutral(1, 1.0), "null or 1.0 (no logit scaling)"),
    FieldRule("logits_scaling", _neutral(1, 1.0), "null or 1.0 (no logit scaling)"),
    FieldRule("embedding_multiplier", _neutral(1, 1.0), "null or 1.0"),
    FieldRule("residual_multiplier", _neutral(1, 1.0), "null or 1.0"),
    FieldRule("attention_multiplier", _neutral(), "null (attention scale is head_dim ** -0.5)"),
    FieldRule("query_pre_attn_scalar", _neutral(), "null (attention scale is head_dim ** -0.5)"),
    FieldRule(
        "quantization_config",
        _neutral(),
        "null: load an unquantized checkpoint (pieceworks quantizes itself with "
        "quantization='fp8')",
    ),
]

LLAMA_RULES = [
    *COMMON_RULES,
    # HF's Llama computes the same result for every value: the slices are summed back.
    FieldRule("pretraining_tp", _positive_int, "a positive integer (any value computes alike)", 1),
]

BAMBA_RULES = [
    *COMMON_RULES,
    _size("mamba_n_heads"),
    _size("mamba_d_state"),
    FieldRule(
        "mamba_d_head",
        lambda value: value == "auto" or _positive_int(value),
        "'auto' or a positive integer",
        "auto",
    ),
    FieldRule("mamba_n_groups", _positive_int, "a positive integer dividing mamba_n_heads", 1),
    FieldRule("mamba_d_conv", _positive_int, "a positive integer", 4),
    FieldRule("mamba_expand", lambda v: _is_number(v) and v > 0, "a positive number", 2),
    FieldRule("mamba_chunk_size", _positive_int, "a positive integer (any value computes alike)"),
    FieldRule("mamba_conv_bias", _is_bool, "true or false", True),
    FieldRule("mamba_proj_bias", _is_bool, "true or false", False),
    FieldRule(
        "time_step_limit",
        lambda value: (
            isinstance(value, (list, tuple))
            and len(value) == 2
            and all(isinstance(v, (int, float)) and not math.isnan(v) for v in value)
            and value[0] <= value[1]
        ),
        "a pair [low, high] with low <= high",
    ),
    FieldRule(
        "attn_layer_indices",
        lambda value: isinstance(value, list) and all(_is_int(i) for i in value),
        "a list of layer indices",
    ),
]


def _replace_rules(rules: list[FieldRule], *new: FieldRule, drop: tuple[str, ...] = ()) -> list:
    """``rules`` with the same-named rules replaced by ``new`` and the ``drop`` names removed."""
    replaced = {rule.name: rule for rule in new}
    kept = [replaced.pop(rule.name, rule) for rule in rules if rule.name not in drop]
    return [*kept, *replaced.values()]


# Qwen2 and Qwen3 carry the sliding-window fields of transformers' config classes; they act only
# with use_sliding_window true (or a 'sliding_attention' entry in layer_types), which are refused.
_QWEN_SLIDING_WINDOW_RULES = (
    FieldRule(
        "use_sliding_window",
        _neutral(False),
        "false (sliding-window attention is not implemented; every layer attends to the whole "
        "context)",
        False,
    ),
    FieldRule(
        "sliding_window",
        _is_int,
        "an integer or null (read only with use_sliding_window true, which is refused)",
    ),
    FieldRule("max_window_layers", _is_int, "an integer (read only with use_sliding_window true)"),
    FieldRule(
        "layer_types",
        lambda value: isinstance(value, list) and all(t == "full_attention" for t in value),
        "null or a list of 'full_attention' ('sliding_attention' is not implemented)",
    ),
)

# HF's Mistral has no bias anywhere (it reads neither bias field) and slides every layer's window.
MISTRAL_RULES = _replace_rules(
    COMMON_RULES,
    FieldRule(
        "sliding_window",
        _positive_int,
        "a positive integer (each layer sees that many last positions) or null (the whole "
        "context); absent: 4096, as MistralConfig",
    ),
    drop=("attention_bias", "mlp_bias"),
)

# HF's Qwen2 has biases on q, k and v and none on o or the MLP, whatever attention_bias and
# mlp_bias say: it reads neither, and neither does pieceworks'.
QWEN2_RULES = _replace_rules(
    COMMON_RULES, *_QWEN_SLIDING_WINDOW_RULES, drop=("attention_bias", "mlp_bias")
)
# HF's Qwen3 reads attention_bias (q, k, v and o) but its MLP never has a bias.
QWEN3_RULES = _replace_rules(COMMON_RULES, *_QWEN_SLIDING_WINDOW_RULES, drop=("mlp_bias",))

_GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention")
_GELU_NAMES = " or ".join(f"{name!r}" for name in HF_GELU_APPROXIMATE)
_positive_number = lambda value: _is_number(value) and value > 0  # noqa: E731

# HF's Gemma 3 reads hidden_activation (not hidden_act) and has no MLP bias; its sliding window,
# layer types, attention scale and final soft-capping are implemented (models/gemma3.py).
GEMMA3_RULES = _replace_rules(
    COMMON_RULES,
    FieldRule("hidden_activation", _one_of(*HF_GELU_APPROXIMATE), f"{_GELU_NAMES} (GeGLU MLP)"),
    FieldRule("sliding_window", _positive_int, "a positive integer (the sliding layers' window)"),
    FieldRule(
        "layer_types",
        lambda value: isinstance(value, list) and all(t in _GEMMA3_LAYER_TYPES for t in value),
        "a list of 'sliding_attention' and 'full_attention', one per layer",
    ),
    FieldRule("sliding_window_pattern", _positive_int, "a positive integer"),
    FieldRule("query_pre_attn_scalar", _positive_number, "a positive number"),
    FieldRule("rope_local_base_freq", _positive_number, "a positive number"),
    FieldRule("final_logit_softcapping", _positive_number, "null or a positive number"),
    FieldRule("attn_logit_softcapping", _neutral(), "null (not implemented)"),
    FieldRule("use_bidirectional_attention", _neutral(False), "false (attention is causal)"),
    drop=("hidden_act", "mlp_bias"),
)

ARCHITECTURE_RULES: dict[str, list[FieldRule]] = {
    "LlamaForCausalLM": LLAMA_RULES,
    "BambaForCausalLM": BAMBA_RULES,
    "Qwen2ForCausalLM": QWEN2_RULES,
    "Qwen3ForCausalLM": QWEN3_RULES,
    "Gemma3ForCausalLM": GEMMA3_RULES,
    "MistralForCausalLM": MISTRAL_RULES,
    "NemotronHForCausalLM": _replace_rules(
        COMMON_RULES, *NEMOTRON_H_FIELDS, drop=NEMOTRON_H_DROPPED
    ),
    "Qwen3_5ForCausalLM": _replace_rules(COMMON_RULES, *QWEN3_5_FIELDS, drop=QWEN3_5_DROPPED),
}
# Bamba rotates part of each head; HF's Llama, Qwen and Gemma 3 rotate all of it.
_PARTIAL_ROTARY = {
    "LlamaForCausalLM": False,
    "BambaForCausalLM": True,
    "Qwen2ForCausalLM": False,
    "Qwen3ForCausalLM": False,
    "Gemma3ForCausalLM": False,
    "MistralForCausalLM": False,
    "NemotronHForCausalLM": False,  # no rotary embedding; rope fields are not read
    "Qwen3_5ForCausalLM": True,
}


def architecture_of(hf_config: dict[str, Any], source: str) -> str:
    """The first supported name in ``architectures``; an error naming the supported ones."""
    architectures = hf_config.get("architectures") or []
    for architecture in architectures:
        if architecture in ARCHITECTURE_RULES:
            return architecture
    raise ModelConfigError(
        f"{source}: architectures={architectures!r} is not supported; pieceworks supports "
        f"{', '.join(supported_architectures())} (set 'architectures' to one of them if the "
        "model is one)"
    )


def check_hf_config(hf_config: Any, source: str = "config.json") -> str:
    """Refuse a config whose computation pieceworks would not match; return its architecture.

    ``source`` names where the config came from (a file path or a preset) in the messages.
    """
    if not isinstance(hf_config, dict):
        raise ModelConfigError(
            f"{source}: a model config must be a JSON object, not {type(hf_config).__name__}"
        )
    architecture = architecture_of(hf_config, source)
    hf_config = with_architecture_defaults(hf_config)
    for rule in ARCHITECTURE_RULES[architecture]:
        _check_field(hf_config, rule, architecture, source)
    _check_heads(hf_config, source)
    if architecture == "Gemma3ForCausalLM":
        _check_gemma3_layers(hf_config, source)
    else:
        _check_rope(hf_config, architecture, source)
    if architecture == "BambaForCausalLM":
        _check_bamba_layers(hf_config, source)
    if architecture == "NemotronHForCausalLM":
        check_nemotron_h_layers(hf_config, source)
    if architecture == "Qwen3_5ForCausalLM":
        check_qwen3_5_layers(hf_config, source)
    return architecture


def _check_field(
    hf_config: dict[str, Any], rule: FieldRule, architecture: str, source: str
) -> None:
    if rule.name not in hf_config:
        if rule.default is _REQUIRED:
            raise ModelConfigError(
                f"{source} lacks {rule.name!r} ({rule.supported}), which {architecture} "
                "needs; add it"
            )
        return
    value = hf_config[rule.name]
    if value is None and rule.default is not _REQUIRED:
        return  # null means the default, as in HF transformers
    if not rule.accepts(value):
        raise ModelConfigError(
            f"{source}: {rule.name}={value!r} is not supported by pieceworks' {architecture}; "
            f"supported: {rule.supported}"
        )


def _check_heads(hf_config: dict[str, Any], source: str) -> None:
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ModelConfigError(
            f"{source}: num_key_value_heads={kv_heads} must divide num_attention_heads={heads}"
        )
    if not hf_config.get("head_dim") and hf_config["hidden_size"] % heads:
        raise ModelConfigError(
            f"{source}: hidden_size={hf_config['hidden_size']} is not divisible by "
            f"num_attention_heads={heads}; set head_dim"
        )


def _check_rope(hf_config: dict[str, Any], architecture: str, source: str) -> None:
    """Rope type, theta and partial rotary, from ``rope_scaling`` and ``rope_parameters``."""
    try:
        base, rope_scaling, partial = get_rope_parameters(hf_config)
    except (TypeError, ValueError) as error:
        raise ModelConfigError(f"{source}: rope_scaling / rope_parameters: {error}") from None
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelConfigError(
            f"{source}: rope type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    needed = {"linear": ["factor"], "llama3": ["factor", "low_freq_factor", "high_freq_factor"]}
    needed["llama3"].append("original_max_position_embeddings")
    absent = [key for key in needed.get(rope_type, []) if key not in (rope_scaling or {})]
    if absent:
        raise ModelConfigError(f"{source}: rope type {rope_type!r} needs {', '.join(absent)}")
    if not math.isfinite(base) or base <= 0:
        raise ModelConfigError(f"{source}: rope_theta={base} must be a positive number")
    if _PARTIAL_ROTARY[architecture]:
        top_level = hf_config.get("partial_rotary_factor")
        if architecture == "BambaForCausalLM" and top_level is not None and top_level != 0.5:
            raise ModelConfigError(
                f"{source}: partial_rotary_factor={top_level} at the top level is not supported "
                f"by {architecture}: transformers' BambaConfig ignores it and rotates half of "
                "each head (0.5); set rope_parameters.partial_rotary_factor instead"
            )
        if not 0 < partial <= 1:
            raise ModelConfigError(
                f"{source}: partial_rotary_factor={partial} is not supported; use a value in (0, 1]"
            )
    elif partial != 1.0:
        raise ModelConfigError(
            f"{source}: partial_rotary_factor={partial} is not supported by {architecture} "
            "(HF's Llama rotates every dim of a head); supported: 1.0"
        )


def _check_gemma3_layers(hf_config: dict[str, Any], source: str) -> None:
    """A type per layer and a valid rope per layer type (``config_defaults`` derives both from
    older keys where the types allow)."""
    layer_types, num_layers = hf_config.get("layer_types"), hf_config["num_hidden_layers"]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ModelConfigError(f"{source}: layer_types must type each of the {num_layers} layers")
    ropes = hf_config.get("rope_parameters")
    if not isinstance(ropes, dict) or {type(ropes.get(t)) for t in _GEMMA3_LAYER_TYPES} != {dict}:
        raise ModelConfigError(
            f"{source}: rope_parameters={ropes!r} is not supported; supported: "
            "{'sliding_attention': {...}, 'full_attention': {...}} or the older rope_theta, "
            "rope_local_base_freq and rope_scaling"
        )
    for layer_type in _GEMMA3_LAYER_TYPES:
        layer_view = {"rope_parameters": ropes[layer_type]}
        _check_rope(layer_view, "Gemma3ForCausalLM", f"{source} ({layer_type} layers)")


def _check_bamba_layers(hf_config: dict[str, Any], source: str) -> None:
    num_layers = hf_config["num_hidden_layers"]
    bad = [i for i in hf_config.get("attn_layer_indices") or [] if not 0 <= i < num_layers]
    if bad:
        raise ModelConfigError(
            f"{source}: attn_layer_indices {bad} are outside the {num_layers} layers "
            f"(0 to {num_layers - 1})"
        )
    heads, groups = hf_config["mamba_n_heads"], hf_config.get("mamba_n_groups") or 1
    if heads % groups:
        raise ModelConfigError(
            f"{source}: mamba_n_groups={groups} must divide mamba_n_heads={heads}"
        )


def check_tensor_parallel(hf_config: dict[str, Any], tp_size: int, source: str) -> None:
    """The sharding errors every rank would hit while building its model, raised once here,
    before any rank starts (the config has passed ``check_hf_config``)."""
    if not _is_int(tp_size) or tp_size <= 1:
        return
    hf_config = with_architecture_defaults(hf_config)
    heads = hf_config["num_attention_heads"]
    checks = [
        lambda: divide(heads, tp_size, "num_attention_heads"),
        lambda: shard_or_replicate(
            hf_config.get("num_key_value_heads") or heads, 0, tp_size, "num_key_value_heads"
        ),
        lambda: divide(hf_config["intermediate_size"], tp_size, "intermediate_size"),
    ]
    if "mamba_n_heads" in hf_config:
        checks.append(lambda: divide(hf_config["mamba_n_heads"], tp_size, "mamba_n_heads"))
        groups = hf_config.get("mamba_n_groups") or 1
        checks.append(lambda: shard_or_replicate(groups, 0, tp_size, "mamba_n_groups"))
    for check in checks:
        try:
            check()
        except ValueError as error:
            raise ModelConfigError(f"{source}: {error}") from None
