"""The HF model every HF peer runs, with pieceworks' weights, and what its decode step reads.

``baseline_model_config`` takes the engine's ``ModelConfig`` for a ``LatencyCase`` (same dtype
rule, seed and config dict; quantization and tensor parallelism are ignored, with a warning);
``build_hf_model`` builds HF's ``AutoModelForCausalLM`` of it on the device and copies in the same
weights as the engine's (``load_hf_weights``, also the gpt-fast loop's loader); ``hf_decode_bytes``
counts the bytes a decode step reads as ``latency.decode_bytes`` does. ``static_cache_skip_reason``
says why a model has no static-cache peer (HF has no static cache for Mamba layers).
``transformers`` is optional (the ``test`` extra) and imported only when a peer runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pieceworks.benchmarks.latency import LatencyCase, _prompts
from pieceworks.config import ModelConfig, resolve_dtype
from pieceworks.engine.arg_utils import build_engine_config
from pieceworks.logger import init_logger
from pieceworks.models.loading.sources import checkpoint_weights
from pieceworks.models.loading.weight_utils import WeightLoadingError, is_ignored_tensor
from pieceworks.platforms import current_platform

logger = init_logger(__name__)


def import_transformers() -> Any:
    """The ``transformers`` module, or a RuntimeError saying how to install it."""
    try:
        import transformers
    except ImportError as error:
        raise RuntimeError(
            "the --compare baselines need HF transformers: pip install transformers "
            "(or pip install 'pieceworks[test]')"
        ) from error
    return transformers


def baseline_model_config(case: LatencyCase) -> ModelConfig:
    """The engine's ``ModelConfig`` for ``case`` (same dtype rule, seed and config dict)."""
    config = build_engine_config(case.model, None, **case.engine_args)
    model_config = config.model_config
    if model_config.quantization is not None:
        logger.warning(
            "baselines run the unquantized model: quantization=%r is ignored for them",
            model_config.quantization,
        )
    if config.parallel_config.tensor_parallel_size > 1:
        logger.warning(
            "baselines run on one device: tensor_parallel_size=%d is ignored for them",
            config.parallel_config.tensor_parallel_size,
        )
    return model_config


def load_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named ``weights`` into ``model`` one tensor at a time; every parameter must load."""
    params = dict(model.named_parameters())  # a tied LM head appears once, as the embedding
    aliases = set(model.state_dict()) - set(params)  # e.g. lm_head.weight when tied
    loaded = set()
    with torch.no_grad():
        for name, tensor in weights:
            if is_ignored_tensor(name) or name in aliases:
                continue
            if name not in params:
                raise WeightLoadingError(
                    f"checkpoint tensor {name!r} has no parameter in HF {type(model).__name__}",
                    name,
                )
            if params[name].shape != tensor.shape:
                raise WeightLoadingError(
                    f"{name}: HF expects shape {tuple(params[name].shape)}, "
                    f"got {tuple(tensor.shape)}",
                    name,
                )
            params[name].copy_(tensor)
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise WeightLoadingError(f"the checkpoint lacks HF parameters {missing[:20]}")


def build_hf_model(model_config: ModelConfig, device: torch.device) -> nn.Module:
    """HF ``AutoModelForCausalLM`` of ``model_config`` on ``device``, with pieceworks' weights."""
    transformers = import_transformers()
    hf_config = dict(model_config.hf_config)
    if "model_type" not in hf_config:
        raise ValueError(f"{model_config.model}: config.json has no 'model_type'; HF needs it")
    config = transformers.AutoConfig.for_model(hf_config.pop("model_type"), **hf_config)
    dtype = resolve_dtype(model_config.dtype, model_config.hf_config)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    load_hf_weights(model, checkpoint_weights(model_config, device))
    model.generation_config.eos_token_id = None  # ignore_eos: always output_len tokens
    return model.eval().requires_grad_(False)


def num_attention_layers(hf_config: dict[str, Any]) -> int:
    if "attn_layer_indices" in hf_config:  # hybrid (Bamba): the rest are Mamba layers
        return len(hf_config["attn_layer_indices"] or [])
    return int(hf_config["num_hidden_layers"])


def static_cache_skip_reason(case: LatencyCase, hf_config: dict[str, Any]) -> str | None:
    """Why the static-cache peers cannot run ``case``'s model (None: they can): they need an
    attention-only Llama."""
    model_type = hf_config.get("model_type")
    attention_only = num_attention_layers(hf_config) == hf_config.get("num_hidden_layers")
    if attention_only and model_type == "llama":
        return None
    return f"needs an attention-only Llama; {case.model} is {model_type!r}" + (
        "" if attention_only else " with Mamba layers (HF has no static cache for them)"
    )


def hf_decode_bytes(model: nn.Module, hf_config: dict[str, Any], case: LatencyCase) -> int:
    """``latency.decode_bytes`` for an HF model: weights but the input embedding, + KV read."""
    embedding = model.get_input_embeddings().weight  # type: ignore[operator]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    output = model.get_output_embeddings()  # type: ignore[operator]
    if output is None or output.weight is not embedding:
        weight_bytes -= embedding.numel() * embedding.element_size()
    num_heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads
    num_kv_heads = hf_config.get("num_key_value_heads") or num_heads
    kv_per_token = (
        num_attention_layers(hf_config) * 2 * num_kv_heads * head_dim * embedding.element_size()
    )
    mean_context = case.input_len + case.output_len / 2
    return int(weight_bytes + case.batch_size * mean_context * kv_per_token)


def load_hf_baseline(case: LatencyCase) -> tuple[ModelConfig, nn.Module, torch.Tensor]:
    """The case's model config, its HF model and its prompts ``(batch, input_len)``, on device."""
    device = current_platform().device()
    model_config = baseline_model_config(case)
    model = build_hf_model(model_config, device)
    prompts = _prompts(case, model_config.hf_config["vocab_size"])
    return model_config, model, torch.tensor(prompts, dtype=torch.long, device=device)
