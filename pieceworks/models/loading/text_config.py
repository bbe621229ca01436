"""The text model's config.json fields out of a vision-language config that nests them.

A Qwen3.5 checkpoint as published is ``Qwen3_5ForConditionalGeneration``: its config.json holds
the language model's fields under ``text_config`` (and the vision tower's under
``vision_config``), and its weights name the language model ``model.language_model.*``.
pieceworks serves the text model: ``text_model_config`` returns the nested fields as a flat
``Qwen3_5ForCausalLM`` config, with the top level's ``tie_word_embeddings`` (the one
transformers reads for the LM head of the whole model) and dtype. Any other config is returned
unchanged. ``hf_directory.load_hf_config`` applies it as it reads config.json.
"""

from __future__ import annotations

from typing import Any

# vision-language architecture -> the architecture of its text model
TEXT_MODEL_OF = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM"}


def text_model_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The flat text-model config of a vision-language ``hf_config``; others unchanged."""
    text_config = hf_config.get("text_config")
    architectures = [a for a in hf_config.get("architectures") or [] if a in TEXT_MODEL_OF]
    if not architectures or not isinstance(text_config, dict):
        return hf_config
    flat = {**text_config, "architectures": [TEXT_MODEL_OF[architectures[0]]]}
    flat["tie_word_embeddings"] = bool(hf_config.get("tie_word_embeddings", False))
    for key in ("dtype", "torch_dtype"):
        if key in hf_config and flat.get(key) is None:
            flat[key] = hf_config[key]
    return flat
