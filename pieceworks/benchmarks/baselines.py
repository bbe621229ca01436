"""What a user would otherwise run: HF transformers baselines for `bench latency --compare`.

Three ways to run the model of a ``LatencyCase`` without pieceworks, on the same device, in the
same dtype, with the same weights (``random_hf_weights`` of the same seed for a preset, the
checkpoint for a directory) and the same prompts (``latency._prompts``):

- ``hf_eager``: ``model.generate(...)`` greedy, eager, HF's default dynamic KV cache.
- ``static_compiled``: the decode loop a capable user writes on HF transformers with the
  "torch.compile with a static cache" recipe: a ``StaticCache`` sized to ``input_len +
  output_len``, an eager prefill, then ``output_len - 1`` one-token steps, each a forward plus
  greedy argmax under ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs where
  the device has them), positions passed explicitly from a device tensor advanced in place. Its
  attention is registered through transformers' ``AttentionInterface`` (``gqa_sdpa_attention``):
  HF's own SDPA path passes ``enable_gqa`` only without a mask, and a static cache always has one,
  so under torch.compile it calls ``repeat_kv`` and copies K and V out to every query head over the
  whole cache each step (at the 8B shape, batch 64, context 1k: tens of GB per step). The
  registered function reads each KV head once instead: a one-token step runs ``flex_attention``
  with ``enable_gqa`` over a causal ``BlockMask`` (gpt-fast's decode, which also skips the cache
  blocks past the position; transformers' own ``flex_attention`` does not compile with
  ``fullgraph`` in transformers 5.17), a prompt SDPA with the query heads of a KV head folded into
  the query length. Each layer's q, k and v projections run as one matmul (``fuse_hf_qkv``, the
  recipe's fused ``wqkv``): HF's three separate projections cost 0.40 ms of device time per step
  at the 8B shape, batch 1 (``benchmarks/profile_peers.py``).
- ``gpt_fast``: an independent hand-written loop (``gpt_fast_loop``: its own Llama modules, its
  own static cache), the check that ``static_compiled`` is not a straw man.

Which apply is decided up front (``applicable_baselines``): the two static loops need an
attention-only Llama (HF has no static cache for Mamba layers), HF eager runs any model HF builds.

Results are shaped like ``latency.measure_mode``'s (``graph_mode`` "baseline", pipeline counters all
zero, ``level`` None), so the CLI table shows them beside the modes. Latency is end to end with one
device sync at the end. ``decode_step_ms`` comes from a separate pass: the static loops time each
compiled step with device events and no host sync between the steps (``step_timing``), as their
loops run and as the engine's steps run in its steady state; HF ``generate`` is timed
by a logits processor (``StepClock``) stamping the time each token is chosen, so one interval is one
whole decode step (token selection, input preparation, forward). The static loops also profile a few
decode steps for their device-busy time (``device_busy``). The floor counts the same bytes as
``latency.decode_bytes``. EOS never stops a baseline (``ignore_eos``, as the bench runs). A
quantized case runs its peers unquantized (HF has no FP8 path of pieceworks' kind): each such row
says so in its ``note``.

Not here: the CLI flag, the table, the copy bandwidth (``latency.measure_copy_bandwidth``).
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
from torch.nn import functional as F
from torch.nn.attention.flex_attention import flex_attention

from pieceworks.benchmarks.device_busy import (
    NUM_PROFILED_STEPS,
    profile_device_busy,
    with_idle_share,
)
from pieceworks.benchmarks.latency import _COUNTERS, LatencyCase, _prompts, _stats
from pieceworks.benchmarks.peers.gpt_fast import (
    GptFastDecoder,
    GptFastLlama,
    causal_block_mask,
    decode_mask,
)
from pieceworks.benchmarks.step_timing import timed_steps
from pieceworks.config import ModelConfig, resolve_dtype
from pieceworks.engine.arg_utils import build_engine_config, resolve_hf_config
from pieceworks.logger import init_logger
from pieceworks.models.loading.sources import checkpoint_weights
from pieceworks.models.loading.weight_utils import WeightLoadingError, is_ignored_tensor
from pieceworks.platforms import current_platform

logger = init_logger(__name__)

BASELINE_MODES = ("static_compiled", "gpt_fast", "hf_eager")
GQA_ATTENTION = "pieceworks_gqa_sdpa"


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
        _num_attention_layers(hf_config) * 2 * num_kv_heads * head_dim * embedding.element_size()
    )
    mean_context = case.input_len + case.output_len / 2
    return int(weight_bytes + case.batch_size * mean_context * kv_per_token)


# ---------------------------------------------------------------------------------------------
# The ways to generate


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


def gqa_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Grouped-query attention over the static cache, reading each KV head once.

    A one-token step of a module carrying ``decode_block_mask`` (``StaticCacheDecoder`` sets it)
    runs ``flex_attention`` with ``enable_gqa`` over that mask's row for the step's position (from
    ``position_ids``), as gpt-fast's decode does: the cache split across programs and the blocks
    past the position skipped. Otherwise SDPA under the mask:

    ``query`` ``(B, H, T, D)``, ``key``/``value`` ``(B, H_kv, S, D)`` (the whole static cache),
    ``attention_mask`` ``(B, 1, T, S)`` or None. The ``n_rep = H / H_kv`` query heads of a KV head
    are folded into the query length, ``(B, H_kv, n_rep * T, D)``, and the mask repeated to
    match, so no ``repeat_kv`` copy of the cache is made. Returns ``(B, T, H, D)`` as HF expects.
    """
    batch, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    n_rep = num_heads // num_kv_heads
    block_mask = getattr(module, "decode_block_mask", None)
    if num_tokens == 1 and block_mask is not None:  # a one-token step: flex attention, as gpt-fast
        position = kwargs.get("position_ids")
        if position is None:
            raise RuntimeError(
                "this transformers version passes no position_ids to the attention function; "
                "the static_compiled loop needs them for its decode mask"
            )
        step_mask = decode_mask(block_mask, position.reshape(-1)[:1], key.shape[-2])
        output = flex_attention(
            query, key, value, block_mask=step_mask, scale=scaling, enable_gqa=n_rep > 1
        )
        return output.transpose(1, 2).contiguous(), None
    folded = query.reshape(batch, num_kv_heads, n_rep * num_tokens, head_dim)
    mask = attention_mask
    if mask is not None:
        mask = mask[..., : key.shape[-2]]
        rows = (mask.shape[0], mask.shape[1], n_rep, num_tokens, mask.shape[-1])
        mask = mask[:, :, None].expand(rows).reshape(rows[0], rows[1], -1, rows[-1])
    elif num_tokens > 1:  # no mask given: causal over a prompt that fills the cache from 0
        mask = torch.ones(num_tokens, key.shape[-2], dtype=torch.bool, device=query.device)
        mask = mask.tril(key.shape[-2] - num_tokens).repeat(n_rep, 1)
    output = F.scaled_dot_product_attention(folded, key, value, attn_mask=mask, scale=scaling)
    output = output.reshape(batch, num_heads, num_tokens, head_dim)
    return output.transpose(1, 2).contiguous(), None


def use_gqa_attention(model: nn.Module) -> None:
    """Register ``gqa_sdpa_attention`` with transformers and make ``model`` use it (masks made
    as for SDPA)."""
    transformers = _transformers()
    transformers.AttentionInterface.register(GQA_ATTENTION, gqa_sdpa_attention)
    masks = getattr(transformers, "AttentionMaskInterface", None)
    if masks is not None:
        from transformers.masking_utils import sdpa_mask

        masks.register(GQA_ATTENTION, sdpa_mask)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(GQA_ATTENTION)  # type: ignore[operator]
    else:
        model.config._attn_implementation = GQA_ATTENTION  # type: ignore[union-attr]


class _QkvParts:
    """What the fused projection hands to ``k_proj`` and ``v_proj`` within one attention call."""

    parts: list[torch.Tensor] | None = None


class _FusedQkvProjection(nn.Module):
    """``q_proj``'s replacement: q, k and v in one matmul of the concatenated weights; the k and
    v columns wait in ``holder`` for the ``k_proj`` and ``v_proj`` calls that follow."""

    def __init__(self, q: nn.Linear, k: nn.Linear, v: nn.Linear, holder: _QkvParts) -> None:
        super().__init__()
        projections = (q, k, v)
        self.weight = nn.Parameter(torch.cat([p.weight for p in projections]), requires_grad=False)
        biases = [p.bias for p in projections]
        self.bias = None
        if all(b is not None for b in biases):
            self.bias = nn.Parameter(torch.cat(biases), requires_grad=False)  # type: ignore[arg-type]
        self.sizes = [p.weight.shape[0] for p in projections]
        self.holder = holder

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        query, key, value = F.linear(hidden_states, self.weight, self.bias).split(self.sizes, -1)
        self.holder.parts = [key, value]
        return query


class _FusedQkvPart(nn.Module):
    """``k_proj`` (``index`` 0) or ``v_proj`` (1) after fusion: the part the fused q projection
    made for this call; ``v_proj`` empties the holder (nothing outlives the attention call)."""

    def __init__(self, holder: _QkvParts, index: int) -> None:
        super().__init__()
        self.holder = holder
        self.index = index

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        parts = self.holder.parts
        if parts is None:
            raise RuntimeError(
                "the fused q/k/v projection of the static_compiled peer expects q_proj to be "
                "called before k_proj and v_proj (this transformers version calls them in "
                "another order); run the peer with fuse_qkv=False"
            )
        if self.index == 1:
            self.holder.parts = None
        return parts[self.index]


def fuse_hf_qkv(model: nn.Module) -> int:
    """Give every attention layer of an HF Llama-family ``model`` one q/k/v matmul, as the
    gpt-fast recipe's ``wqkv`` (Inductor does not merge matmuls of unequal widths itself, and a
    one-token step reads the input once instead of three times); how many layers were fused.
    The three projections keep their names and call order, so HF's attention code is unchanged."""
    fused = 0
    for module in model.modules():
        q, k, v = (getattr(module, name, None) for name in _QKV_NAMES)
        if not (isinstance(q, nn.Linear) and isinstance(k, nn.Linear) and isinstance(v, nn.Linear)):
            continue
        holder = _QkvParts()
        module.q_proj = _FusedQkvProjection(q, k, v, holder)
        module.k_proj = _FusedQkvPart(holder, 0)
        module.v_proj = _FusedQkvPart(holder, 1)
        fused += 1
    return fused


_QKV_NAMES = ("q_proj", "k_proj", "v_proj")


class StaticCacheDecoder:
    """The HF static-cache loop: a ``StaticCache``, eager prefill, compiled one-token decode.

    The compiled step reads and writes the cache in place (``StaticCache`` marks its tensors as
    static addresses), so "reduce-overhead" can replay one CUDA graph per step. Positions come
    from a device tensor advanced in place (no cache-length query per step). The step's output
    buffer belongs to the graph and is overwritten by the next replay: each token is cloned out.
    ``gqa=False`` keeps HF's own attention (for comparing the two); ``fuse_qkv`` (on by
    default, as the independent loop and the engine do) makes each layer's q/k/v one matmul
    (``fuse_hf_qkv``).
    """

    def __init__(
        self, model: nn.Module, max_cache_len: int, compile_backend: str | Callable = "inductor",
        gqa: bool = True, fuse_qkv: bool = True,
    ) -> None:  # fmt: skip
        transformers = _transformers()
        self.model = model
        if fuse_qkv:
            fuse_hf_qkv(model)
        if gqa:
            use_gqa_attention(model)
            block_mask = causal_block_mask(max_cache_len, next(model.parameters()).device)
            for layer in model.model.layers:  # type: ignore[union-attr]
                layer.self_attn.decode_block_mask = block_mask
        self.cache = transformers.StaticCache(config=model.config, max_cache_len=max_cache_len)
        # transformers 5.24 names it ``cache`` (``past_key_values`` deprecated); 5.17 does not.
        forward_args = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        backbone_args = inspect.signature(model.model.forward).parameters  # type: ignore[union-attr]
        self.pass_cache_position = "cache_position" in backbone_args
        # ``mode`` is an Inductor option; other backends (e.g. "eager" in tests) take none.
        mode = "reduce-overhead" if compile_backend == "inductor" else None
        self.decode_step = torch.compile(
            self.forward_argmax, fullgraph=True, backend=compile_backend, mode=mode
        )

    def reset(self) -> None:
        """Empty the cache in place (same tensors, so the compiled step's graph stays valid)."""
        self.cache.reset()

    def forward_argmax(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Append ``token_ids`` ``(batch, T)`` at ``positions`` ``(T,)``; greedy next token."""
        kwargs: dict[str, Any] = {self.cache_arg: self.cache, "position_ids": positions[None]}
        if self.pass_cache_position:
            kwargs["cache_position"] = positions
        logits = self.model(
            input_ids=token_ids, use_cache=True, logits_to_keep=1, return_dict=False, **kwargs
        )[0]  # (batch, 1, vocab): a long prefill never materialises logits for every position
        return logits[:, -1].argmax(dim=-1, keepdim=True)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts ``(B, T)`` into the cache (``reset()`` first): first tokens, next position."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.forward_argmax(input_ids, positions), positions[-1:] + 1

    @torch.no_grad()
    def decode(
        self, token_ids: torch.Tensor, position: torch.Tensor, num_steps: int,
        step_seconds: list[float] | None = None,
    ) -> list[torch.Tensor]:  # fmt: skip
        """``num_steps`` compiled steps (``position`` advanced in place); ``step_seconds`` gets
        each step's time (``step_timing.timed_steps``: no sync between steps)."""
        state = [token_ids]

        def step() -> torch.Tensor:
            torch.compiler.cudagraph_mark_step_begin()
            state[0] = self.decode_step(state[0], position).clone()  # the graph owns its output
            position.add_(1)
            return state[0]

        if step_seconds is None:
            return [step() for _ in range(num_steps)]
        return timed_steps(step, num_steps, step_seconds)

    def generate(
        self, input_ids: torch.Tensor, num_tokens: int, step_seconds: list[float] | None = None
    ) -> torch.Tensor:
        """Greedy ``(batch, num_tokens)`` (call ``reset()`` first); ``step_seconds`` times steps."""
        token_ids, position = self.prefill(input_ids)
        steps = self.decode(token_ids, position, num_tokens - 1, step_seconds)
        return torch.cat([token_ids, *steps], dim=1)


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
    startup: dict[str, Any],
    floor_bytes: int,
    bandwidth: float | None,
    busy: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``measure_mode`` shape: ``startup`` has startup_s, load_s, compile_s, capture_s."""
    decode_ms = _stats([s * 1e3 for s in step_seconds])
    if busy is None:
        busy = {"device_busy_ms": None, "device_idle_share": None,
                "device_busy_note": "n/a: not profiled for this peer"}  # fmt: skip
    result: dict[str, Any] = {
        "mode": mode,
        "merged_modes": [],
        "status": "ok",
        "level": None,
        "graph_mode": "baseline",
        "backend": None,
        "latency_s": _stats(latencies),
        "decode_step_ms": decode_ms,
        "num_decode_steps": len(step_seconds),
        **with_idle_share(busy, decode_ms["median"]),
        **startup,
        "graph_memory_gib": None,
        "counters": dict.fromkeys(_COUNTERS, 0),
        "first_output_token_ids": tokens[0, :16].tolist() if tokens.numel() else [],
    }
    quantization = case.engine_args.get("quantization")
    if quantization:
        result["note"] = f"runs the unquantized model (quantization={quantization} is ignored)"
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
    startup = {"startup_s": load_seconds, "load_s": load_seconds, "compile_s": None,
               "capture_s": None}  # fmt: skip
    return _result(
        "hf_eager", case, latencies, clock.step_seconds(), tokens, startup, floor_bytes, bandwidth
    )


def applicable_baselines(case: LatencyCase) -> tuple[list[str], list[dict[str, str]]]:
    """The peers that can run ``case``'s model, and the others with the reason (for the report)."""
    hf_config = resolve_hf_config(case.model)
    model_type = hf_config.get("model_type")
    attention_only = _num_attention_layers(hf_config) == hf_config.get("num_hidden_layers")
    run, skipped = [], []
    static_loops_apply = attention_only and model_type == "llama"
    for name in BASELINE_MODES:
        reason = None
        if name in ("static_compiled", "gpt_fast") and not static_loops_apply:
            reason = f"needs an attention-only Llama; {case.model} is {model_type!r}" + (
                "" if attention_only else " with Mamba layers (HF has no static cache for them)"
            )
        if reason:
            skipped.append({"mode": name, "reason": reason})
        else:
            run.append(name)
    return run, skipped


def _check_attention_only(case: LatencyCase) -> None:
    _, skipped = applicable_baselines(case)
    for entry in skipped:
        if entry["mode"] == "static_compiled":
            raise ValueError(f"{case.model}: the static-cache baseline {entry['reason']}")


def _measure_static_loop(
    case: LatencyCase, decoder: Any, model: nn.Module, input_ids: torch.Tensor,
    start: float, load_seconds: float, reset: Callable[[], None],
) -> tuple[list[float], list[float], torch.Tensor, dict[str, Any], dict[str, Any]]:  # fmt: skip
    """Startup, timed runs, per-step times and the device-busy profile of a static loop.

    Startup is loading plus one generation: ``compile_s`` is its first compiled step (Dynamo and
    Inductor), ``capture_s`` its second (where reduce-overhead records the CUDA graph; cudagraph
    trees warm up on a function's first call).
    """
    startup_steps: list[float] = []
    reset()
    decoder.generate(input_ids, case.output_len, startup_steps)
    startup_steps += [0.0, 0.0]  # output_len < 3 has fewer compiled steps
    startup = {
        "startup_s": time.perf_counter() - start,
        "load_s": load_seconds,
        "compile_s": startup_steps[0],
        "capture_s": startup_steps[1],
    }
    latencies, tokens = _timed_latencies(
        case, functools.partial(decoder.generate, input_ids, case.output_len), reset
    )
    step_seconds: list[float] = []
    reset()
    decoder.generate(input_ids, case.output_len, step_seconds)
    reset()
    first, position = decoder.prefill(input_ids)
    num_steps = min(NUM_PROFILED_STEPS, case.output_len - 1)

    def run_steps() -> None:  # the tokens it returns are not a step count
        decoder.decode(first, position, num_steps)

    busy = profile_device_busy(run_steps, num_steps)
    return latencies, step_seconds, tokens, startup, busy


def measure_static_cache_compiled(
    case: LatencyCase, bandwidth: float | None = None, compile_backend: str = "inductor"
) -> dict[str, Any]:
    """Time the HF static-cache loop under torch.compile; a ``measure_mode`` result.

    ``compile_backend="eager"`` makes tests fast.
    """
    _check_attention_only(case)
    start = time.perf_counter()
    model_config, model, input_ids = load_hf_baseline(case)
    load_seconds = time.perf_counter() - start
    floor_bytes = hf_decode_bytes(model, model_config.hf_config, case)
    decoder: Any = None
    try:
        decoder = StaticCacheDecoder(model, case.input_len + case.output_len, compile_backend)
        latencies, step_seconds, tokens, startup, busy = _measure_static_loop(
            case, decoder, model, input_ids, start, load_seconds, decoder.reset
        )
    finally:  # also when it raised: the compiled step, its graph pool and the weights go
        decoder = None
        del model, input_ids
        _release_compiled()
    return _result(
        "static_compiled", case, latencies, step_seconds, tokens, startup, floor_bytes,
        bandwidth, busy,
    )  # fmt: skip


def build_gpt_fast_model(
    model_config: ModelConfig, device: torch.device, batch_size: int, max_len: int,
    attention: str = "flex", fuse_qkv: bool = True,
) -> GptFastLlama:  # fmt: skip
    """The independent loop's Llama on ``device``, with the same weights as the other peers.

    ``attention`` as ``GptFastLlama.setup_caches`` takes it; ``fuse_qkv``: one q/k/v matmul per
    layer, as gpt-fast's ``wqkv``."""
    dtype = resolve_dtype(model_config.dtype, model_config.hf_config)
    model = GptFastLlama.empty(model_config.hf_config, dtype, device)
    load_hf_weights(model, checkpoint_weights(model_config, device))
    if fuse_qkv:
        model.fuse_qkv()
    model.setup_caches(batch_size, max_len, attention)
    return model.eval().requires_grad_(False)


def measure_gpt_fast(
    case: LatencyCase, bandwidth: float | None = None, compile_backend: str = "inductor"
) -> dict[str, Any]:
    """Time the independent gpt-fast-style loop; a ``measure_mode``-shaped result."""
    start = time.perf_counter()
    device = current_platform().device()
    model_config = baseline_model_config(case)
    model = build_gpt_fast_model(
        model_config, device, case.batch_size, case.input_len + case.output_len
    )
    prompts = _prompts(case, model_config.hf_config["vocab_size"])
    input_ids = torch.tensor(prompts, dtype=torch.long, device=device)
    load_seconds = time.perf_counter() - start
    floor_bytes = hf_decode_bytes(model, model_config.hf_config, case)
    decoder: Any = None
    try:
        decoder = GptFastDecoder(model, compile_backend)
        latencies, step_seconds, tokens, startup, busy = _measure_static_loop(
            case, decoder, model, input_ids, start, load_seconds, lambda: None
        )
    finally:
        decoder = None
        del model, input_ids
        _release_compiled()
    return _result(
        "gpt_fast", case, latencies, step_seconds, tokens, startup, floor_bytes, bandwidth, busy
    )


BASELINES: dict[str, Callable[..., dict[str, Any]]] = {
    "static_compiled": measure_static_cache_compiled,
    "gpt_fast": measure_gpt_fast,
    "hf_eager": measure_hf_eager,
}


def _free_device_memory() -> None:
    gc.collect()
    current_platform().empty_cache()


def _release_compiled() -> None:
    """Drop torch.compile's state (the compiled step, its CUDA graph pool), then free memory."""
    torch.compiler.reset()
    _free_device_memory()
