"""Architecture name (config.json's ``architectures``) -> model class, imported lazily.

Importing this module imports no model: each entry is a qualname string, resolved on first use, so
listing what is supported costs nothing and a model's heavy imports happen only when it is built.
"""

from __future__ import annotations

from typing import Any

from pieceworks.utils import resolve_obj_by_qualname

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "pieceworks.models.llama.LlamaForCausalLM",
    "BambaForCausalLM": "pieceworks.models.bamba.BambaForCausalLM",
    "Qwen2ForCausalLM": "pieceworks.models.qwen2.Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "pieceworks.models.qwen3.Qwen3ForCausalLM",
    "Gemma3ForCausalLM": "pieceworks.models.gemma3.Gemma3ForCausalLM",
    "MistralForCausalLM": "pieceworks.models.mistral.MistralForCausalLM",
    "NemotronHForCausalLM": "pieceworks.models.nemotron_h.NemotronHForCausalLM",
    "Qwen3_5ForCausalLM": "pieceworks.models.qwen3_5.Qwen3_5ForCausalLM",
}

# Architectures with recurrent layers (Mamba2, Gated DeltaNet): each request keeps a fixed-size
# state in a state slot, which a cached prefix of KV blocks cannot restore, so features that
# reuse KV blocks across requests (prefix caching) must be off for them.
HYBRID_ARCHITECTURES = frozenset({"BambaForCausalLM", "NemotronHForCausalLM", "Qwen3_5ForCausalLM"})


def is_hybrid(hf_config: dict[str, Any]) -> bool:
    """Whether the config's architecture keeps a recurrent state per request."""
    return any(name in HYBRID_ARCHITECTURES for name in hf_config.get("architectures") or [])


def supported_architectures() -> list[str]:
    """Architecture names pieceworks can build, sorted."""
    return sorted(_MODELS)


def get_model_class(hf_config: dict[str, Any]) -> type:
    """The class for the first supported name in ``hf_config["architectures"]``."""
    architectures = hf_config.get("architectures") or []
    for architecture in architectures:
        if architecture in _MODELS:
            return resolve_obj_by_qualname(_MODELS[architecture])
    raise ValueError(
        f"config.json architectures {architectures} are not supported; pieceworks supports "
        f"{', '.join(supported_architectures())}"
    )
