"""What a user would otherwise run: HF transformers baselines for `bench latency --compare`.

Two ways to run the model of a ``LatencyCase`` without pieceworks, on the same device, in the same
dtype, with the same weights (``random_hf_weights`` of the same seed for a preset, the checkpoint
for a directory) and the same prompts (``benchmark._prompts``):

- ``hf_eager``: ``model.generate(...)`` greedy, eager, HF's default dynamic KV cache.
- ``static_compiled``: the hand-written decode loop of the HF/PyTorch "torch.compile with a static
  cache" recipe (gpt-fast style): a ``StaticCache`` sized to ``input_len + output_len``, an eager
  prefill, then ``output_len - 1`` one-token steps, each a forward plus greedy argmax under
  ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs where the device has them).

Results are shaped like ``benchmark.measure_mode``'s (``graph_mode`` "baseline", pipeline counters
all zero), so the CLI table shows them beside the modes. Latency is end to end with one device sync
at the end. ``decode_step_ms`` comes from a separate pass that syncs the device at every step, as
the engine's steps do: the static loop times each compiled step; HF ``generate`` is timed by a
logits processor (``StepClock``) stamping the time each token is chosen, so one interval is one
whole decode step (token selection, input preparation, forward). The floor counts the same bytes as
``benchmark.decode_bytes``. EOS never stops a baseline (``ignore_eos``, as the bench runs).

Not here: the CLI flag, the table, the copy bandwidth (``benchmark.measure_copy_bandwidth``).
``transformers`` is optional (the ``test`` extra) and imported only when a baseline runs.
"""

from __future__ import annotations

import functools
import gc
import inspect
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pieceworks.benchmarks.latency import _COUNTERS, LatencyCase, _prompts, _stats
from pieceworks.config import ModelConfig, resolve_dtype
from pieceworks.engine.arg_utils import build_engine_config, resolve_hf_config
from pieceworks.logger import init_logger
from pieceworks.models.loader import WeightLoadingError, is_ignored_tensor
from pieceworks.models.sources import checkpoint_weights
from pieceworks.platforms import current_platform

logger = init_logger(__name__)

BASELINE_MODES = ("hf_eager", "static_compiled")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise RuntimeError(
            "the --compare baselines need HF transformers: pip install transformers "
            "(or pip install 'pieceworks[test]')"
        ) from error
    return transformers


# ---------------------------------------------------------------------------------------------
# The HF model, with pieceworks' weights


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
    transformers = _transformers()
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


def _num_attention_layers(hf_config: dict[str, Any]) -> int:
    if "attn_layer_indices" in hf_config:  # hybrid (Bamba): the rest are Mamba layers
        return len(hf_config["attn_layer_indices"] or [])
    return int(hf_config["num_hidden_layers"])


def hf_decode_bytes(model: nn.Module, hf_config: dict[str, Any], case: LatencyCase) -> int:
    """``benchmark.decode_bytes`` for an HF model: weights but the input embedding, + KV read."""
    embedding = model.get_input_embeddings().weight  # type: ignore[operator]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    output = model.get_output_embeddings()  # type: ignore[operator]
    if output is None or output.weight is not embedding:
        weight_bytes -= embedding.numel() * embedding.element_size()
    num_heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads
    num_kv_heads = hf_config.get("num_key_value_heads") or num_heads
    kv_per_token = (
        _num_attention_layers(hf_config) * 2 * num_kv_heads * head_dim * embedding.element_size()
    )
    mean_context = case.input_len + case.output_len / 2
    return int(weight_bytes + case.batch_size * mean_context * kv_per_token)


# ---------------------------------------------------------------------------------------------
# The two ways to generate


class StepClock:
    """An HF logits processor that stamps (after a device sync) when each token is chosen."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        current_platform().synchronize()
        self.stamps.append(time.perf_counter())
        return scores

    def step_seconds(self) -> list[float]:
        """One interval per decode step: from one token's choice to the next one's."""
        return [later - earlier for earlier, later in zip(self.stamps, self.stamps[1:])]


def hf_generate(
    model: nn.Module, input_ids: torch.Tensor, num_tokens: int, clock: StepClock | None = None
) -> torch.Tensor:
    """Greedy ``model.generate`` of exactly ``num_tokens`` tokens: ``(batch, num_tokens)``."""
    output = model.generate(  # type: ignore[operator]
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        logits_processor=_transformers().LogitsProcessorList([] if clock is None else [clock]),
    )
    return output[:, input_ids.shape[1] :]


class StaticCacheDecoder:
    """The hand-written loop: a ``StaticCache``, eager prefill, compiled one-token decode.

    The compiled step reads and writes the cache in place (``StaticCache`` marks its tensors as
    static addresses), so "reduce-overhead" can replay one CUDA graph per step. Its output buffer
    belongs to the graph and is overwritten by the next replay: each token is cloned out.
    """

    def __init__(self, model: nn.Module, max_cache_len: int, compile_backend: str = "inductor"):
        transformers = _transformers()
        self.model = model
        self.cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
        # transformers 5.24 names it ``cache`` (``past_key_values`` deprecated); 5.17 does not.
        forward_args = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        # ``mode`` is an Inductor option; other backends (e.g. "eager" in tests) take none.
        mode = "reduce-overhead" if compile_backend == "inductor" else None
        self.decode_step = torch.compile(
            self.forward_argmax, fullgraph=True, backend=compile_backend, mode=mode
        )

    def reset(self) -> None:
        """Empty the cache in place (same tensors, so the compiled step's graph stays valid)."""
        self.cache.reset()

    def forward_argmax(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Append ``token_ids`` ``(batch, num_tokens)`` to the cache; greedy next ``(batch, 1)``."""
        cache = {self.cache_arg: self.cache}
        logits = self.model(
            input_ids=token_ids, use_cache=True, logits_to_keep=1, return_dict=False, **cache
        )[0]  # (batch, 1, vocab): a long prefill never materialises logits for every position
        return logits[:, -1].argmax(dim=-1, keepdim=True)

    @torch.no_grad()
    def generate(
        self, input_ids: torch.Tensor, num_tokens: int, step_seconds: list[float] | None = None
    ) -> torch.Tensor:
        """Greedy ``(batch, num_tokens)`` (call ``reset()`` first); ``step_seconds`` times steps."""
        platform = current_platform()
        token_ids = self.forward_argmax(input_ids)  # prefill, uncompiled (batch, 1)
        generated = [token_ids]
        for _ in range(num_tokens - 1):
            if step_seconds is not None:
                platform.synchronize()
                start = time.perf_counter()
            torch.compiler.cudagraph_mark_step_begin()
            token_ids = self.decode_step(token_ids).clone()
            if step_seconds is not None:
                platform.synchronize()
                step_seconds.append(time.perf_counter() - start)
            generated.append(token_ids)
        return torch.cat(generated, dim=1)


# ---------------------------------------------------------------------------------------------
# Measurement


def _timed_latencies(
    case: LatencyCase,
    generate: Callable[[], torch.Tensor],
    prepare: Callable[[], None] = lambda: None,
) -> tuple[list[float], torch.Tensor]:
    """Warm-ups, then ``num_iters`` end-to-end runs, each ending in one device sync.

    ``prepare`` runs before each, outside the clock (the static loop empties its cache there).
    """
    platform = current_platform()
    for _ in range(case.num_iters_warmup):
        prepare()
        generate()
    latencies, tokens = [], torch.empty(0, dtype=torch.long)
    for _ in range(case.num_iters):
        prepare()
        platform.synchronize()
        start = time.perf_counter()
        tokens = generate()
        platform.synchronize()
        latencies.append(time.perf_counter() - start)
    return latencies, tokens


def _result(
    mode: str,
    case: LatencyCase,
    latencies: list[float],
    step_seconds: list[float],
    tokens: torch.Tensor,
    startup: dict[str, float],
    floor_bytes: int,
    bandwidth: float | None,
) -> dict[str, Any]:
    """The ``measure_mode`` shape: ``startup`` has startup_s, load_s, compile_s, capture_s."""
    decode_ms = _stats([s * 1e3 for s in step_seconds])
    result: dict[str, Any] = {
        "mode": mode,
        "graph_mode": "baseline",
        "latency_s": _stats(latencies),
        "decode_step_ms": decode_ms,
        **startup,
        "graph_memory_gib": 0.0,
        "counters": dict.fromkeys(_COUNTERS, 0),
        "first_output_token_ids": tokens[0, :16].tolist() if tokens.numel() else [],
    }
    if bandwidth:
        floor_ms = floor_bytes / bandwidth * 1e3
        result["floor_ms"] = floor_ms
        result["ratio_to_floor"] = decode_ms["median"] / floor_ms if step_seconds else None
    return result


def load_hf_baseline(case: LatencyCase) -> tuple[ModelConfig, nn.Module, torch.Tensor]:
    """The case's model config, its HF model and its prompts ``(batch, input_len)``, on device."""
    device = current_platform().device()
    model_config = baseline_model_config(case)
    model = build_hf_model(model_config, device)
    prompts = _prompts(case, model_config.hf_config["vocab_size"])
    return model_config, model, torch.tensor(prompts, dtype=torch.long, device=device)


def measure_hf_eager(case: LatencyCase, bandwidth: float | None = None) -> dict[str, Any]:
    """Time HF ``generate`` (greedy, eager) for ``case``; a ``measure_mode``-shaped result."""
    start = time.perf_counter()
    model_config, model, input_ids = load_hf_baseline(case)
    load_seconds = time.perf_counter() - start
    latencies, tokens = _timed_latencies(
        case, functools.partial(hf_generate, model, input_ids, case.output_len)
    )
    clock = StepClock()
    hf_generate(model, input_ids, case.output_len, clock)
    floor_bytes = hf_decode_bytes(model, model_config.hf_config, case)
    del model, input_ids
    _free_device_memory()
    startup = {
        "startup_s": load_seconds,
        "load_s": load_seconds,
        "compile_s": 0.0,
        "capture_s": 0.0,
    }
    return _result(
        "hf_eager", case, latencies, clock.step_seconds(), tokens, startup, floor_bytes, bandwidth
    )


def _check_attention_only(case: LatencyCase) -> None:
    hf_config = resolve_hf_config(case.model)
    if _num_attention_layers(hf_config) != hf_config.get("num_hidden_layers"):
        raise ValueError(
            f"{case.model}: the static-cache baseline needs an attention-only model; HF has no "
            "static cache for Mamba layers (compare with the hf_eager baseline instead)"
        )


def measure_static_cache_compiled(
    case: LatencyCase, bandwidth: float | None = None, compile_backend: str = "inductor"
) -> dict[str, Any]:
    """Time the hand-written static-cache loop under torch.compile; a ``measure_mode`` result.

    Startup is loading plus one generation: ``compile_s`` is its first compiled step (Dynamo and
    Inductor), ``capture_s`` its second (where reduce-overhead records the CUDA graph; cudagraph
    trees warm up on a function's first call). ``compile_backend="eager"`` makes tests fast.
    """
    _check_attention_only(case)
    start = time.perf_counter()
    model_config, model, input_ids = load_hf_baseline(case)
    load_seconds = time.perf_counter() - start
    decoder = StaticCacheDecoder(model, case.input_len + case.output_len, compile_backend)
    startup_steps: list[float] = []
    decoder.reset()
    decoder.generate(input_ids, case.output_len, startup_steps)
    startup_steps += [0.0, 0.0]  # output_len < 3 has fewer compiled steps
    startup_seconds = time.perf_counter() - start
    latencies, tokens = _timed_latencies(
        case, functools.partial(decoder.generate, input_ids, case.output_len), decoder.reset
    )
    step_seconds: list[float] = []
    decoder.reset()
    decoder.generate(input_ids, case.output_len, step_seconds)
    floor_bytes = hf_decode_bytes(model, model_config.hf_config, case)
    del decoder, model, input_ids
    torch.compiler.reset()  # drops the compiled step and its graph pool
    _free_device_memory()
    startup = {
        "startup_s": startup_seconds,
        "load_s": load_seconds,
        "compile_s": startup_steps[0],
        "capture_s": startup_steps[1],
    }
    return _result(
        "static_compiled", case, latencies, step_seconds, tokens, startup, floor_bytes, bandwidth
    )


def _free_device_memory() -> None:
    gc.collect()
    current_platform().empty_cache()
