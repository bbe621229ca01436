"""Llama building blocks, checkpoint loading and presets, on the CPU, against HF transformers.

Proves: RMSNorm (plain and fused-residual) equals HF ``LlamaRMSNorm``; rotary equals HF
``LlamaRotaryEmbedding`` + ``apply_rotary_pos_emb`` for default and ``llama3`` scaling, and partial
rotary equals the textbook formula; merged qkv / gate_up weights loaded from separate HF tensors
compute the separate projections; the loader names missing, unexpected and mis-shaped tensors;
save/load round-trips (sharded index included); meta-device models materialise with ties and
rotary caches intact; presets match HF's own parameter names and shapes. The full-model logit
equivalence lives elsewhere (it needs the attention layer); ``hf_reference.py`` holds its helpers.

Run: cd /work/main && /work/venv/bin/python -m pytest tests/models/test_llama_layers.py -q
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pieceworks.models import registry
from pieceworks.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope,
    silu_and_mul,
)
from pieceworks.models.layers.rotary_embedding import get_rope_parameters
from pieceworks.models.loading import hf_directory, loader, presets, sources, weight_utils

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# RMSNorm, silu_and_mul


def _hf_norm(weight: torch.Tensor, eps: float) -> nn.Module:
    norm = modeling_llama.LlamaRMSNorm(weight.numel(), eps=eps)
    norm.weight.data.copy_(weight)
    return norm


def test_rms_norm_matches_hf() -> None:
    x, weight = _randn(7, 64), 1 + 0.1 * _randn(64, seed=1)
    ours = RMSNorm(64, eps=1e-5)
    ours.weight.data.copy_(weight)
    torch.testing.assert_close(ours(x), _hf_norm(weight, 1e-5)(x), rtol=0, atol=0)


def test_rms_norm_fused_residual_returns_norm_of_sum_and_sum() -> None:
    x, residual, weight = _randn(7, 64), _randn(7, 64, seed=1), 1 + 0.1 * _randn(64, seed=2)
    ours = RMSNorm(64, eps=1e-6)
    ours.weight.data.copy_(weight)
    normed, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, x + residual, rtol=0, atol=0)
    torch.testing.assert_close(normed, _hf_norm(weight, 1e-6)(x + residual), rtol=0, atol=0)


def test_rms_norm_computes_in_float32_and_returns_input_dtype() -> None:
    x, residual = _randn(5, 32).bfloat16(), _randn(5, 32, seed=1).bfloat16()
    norm = RMSNorm(32).to(torch.bfloat16)
    normed, new_residual = norm(x, residual)
    assert normed.dtype == new_residual.dtype == torch.bfloat16
    expected = (x.float() + residual.float()) * torch.rsqrt(
        (x.float() + residual.float()).pow(2).mean(-1, keepdim=True) + 1e-6
    )
    torch.testing.assert_close(normed, expected.bfloat16())


def test_silu_and_mul() -> None:
    x = _randn(3, 10)
    torch.testing.assert_close(silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])


# ---------------------------------------------------------------------------------------------
# Rotary embedding


def _hf_rotary(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, **config_kwargs: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's rotary on flattened ``(T, H * D)`` inputs (reshaped to HF's (1, H, T, D))."""
    config = transformers.LlamaConfig(**config_kwargs)
    head_dim = config.hidden_size // config.num_attention_heads
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    cos, sin = rotary(query, positions[None])  # (1, T, D)

    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], -1, head_dim).transpose(0, 1)[None]  # (1, H, T, D)

    def tokens_first(x: torch.Tensor) -> torch.Tensor:
        return x[0].transpose(0, 1).flatten(1)  # (T, H * D)

    q, k = modeling_llama.apply_rotary_pos_emb(heads_first(query), heads_first(key), cos, sin)
    return tokens_first(q), tokens_first(k)


@pytest.mark.parametrize(
    ("rope_theta", "rope_scaling", "max_position"),
    [(10000.0, None, 2048), (500000.0, LLAMA3_SCALING, 131072)],
    ids=["default", "llama3"],
)
def test_rotary_matches_hf(rope_theta: float, rope_scaling: dict | None, max_position: int) -> None:
    head_dim, num_heads, num_kv_heads = 32, 4, 2
    positions = torch.tensor([0, 1, 5, 2047, 9000, 100000]) % max_position  # unsorted, far apart
    query = _randn(6, num_heads * head_dim)
    key = _randn(6, num_kv_heads * head_dim, seed=1)
    rope = get_rope(head_dim, head_dim, max_position, rope_theta, rope_scaling, dtype=torch.float32)
    ours = rope(positions, query, key)
    reference = _hf_rotary(
        positions,
        query,
        key,
        hidden_size=num_heads * head_dim,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position,
        rope_theta=rope_theta,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,  # HF edits the dict it gets
    )
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


def _rotary_by_formula(
    positions: torch.Tensor, x: torch.Tensor, head_size: int, rotary_dim: int, neox: bool
) -> torch.Tensor:
    """RoPE written out per pair of dims in float64: the definition, not an implementation."""
    x = x.double().view(x.shape[0], -1, head_size).clone()  # (T, H, D)
    half = rotary_dim // 2
    for i in range(half):
        angle = positions.double() * 10000.0 ** (-2 * i / rotary_dim)  # (T,)
        cos, sin = angle.cos()[:, None], angle.sin()[:, None]
        a, b = (i, i + half) if neox else (2 * i, 2 * i + 1)
        xa, xb = x[:, :, a].clone(), x[:, :, b].clone()
        x[:, :, a], x[:, :, b] = xa * cos - xb * sin, xb * cos + xa * sin
    return x.flatten(1).float()


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
def test_partial_rotary_rotates_only_the_first_rotary_dims(neox: bool) -> None:
    head_size, rotary_dim, num_heads = 16, 8, 3
    positions = torch.tensor([0, 3, 17, 250])
    query, key = _randn(4, num_heads * head_size), _randn(4, head_size, seed=1)
    rope = get_rope(head_size, rotary_dim, 256, 10000.0, None, neox, dtype=torch.float32)
    q, k = rope(positions, query, key)
    expected_q = _rotary_by_formula(positions, query, head_size, rotary_dim, neox)
    torch.testing.assert_close(q, expected_q, rtol=0, atol=1e-5)
    torch.testing.assert_close(k, _rotary_by_formula(positions, key, head_size, rotary_dim, neox))
    passthrough = q.view(4, num_heads, head_size)[..., rotary_dim:]
    torch.testing.assert_close(passthrough, query.view(4, num_heads, head_size)[..., rotary_dim:])


def test_rotate_heads_of_side_by_side_q_and_k_equals_rotating_each() -> None:
    """The Llama layer rotates q and k as one (T, (Hq + Hkv) * D) slice of qkv (one kernel)."""
    head_size, num_heads, num_kv_heads = 16, 4, 2
    positions = torch.tensor([0, 3, 17, 250])
    qkv = _randn(4, (num_heads + 2 * num_kv_heads) * head_size)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    query, key, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    rope = get_rope(head_size, head_size, 256, 10000.0, None, dtype=torch.float32)
    rotated = rope.rotate_heads(positions, qkv[:, : q_size + kv_size])
    q, k = rotated.split([q_size, kv_size], dim=-1)
    expected_q, expected_k = rope(positions, query, key)
    torch.testing.assert_close(q, expected_q, rtol=0, atol=0)
    torch.testing.assert_close(k, expected_k, rtol=0, atol=0)
    assert not torch.equal(q, query)  # it did rotate


def test_rotary_cache_is_non_persistent_and_rebuilt_after_to_empty() -> None:
    with torch.device("meta"):
        rope = get_rope(16, 16, 64, 10000.0, None, dtype=torch.float32)
    assert rope.cos_sin_cache.is_meta
    assert "cos_sin_cache" not in rope.state_dict()
    loader.materialize_model(rope, "cpu")
    expected = get_rope(16, 16, 64, 10000.0, None, dtype=torch.float32).cos_sin_cache
    torch.testing.assert_close(rope.cos_sin_cache, expected, rtol=0, atol=0)


def test_rotary_rejects_unsupported_scaling_by_name() -> None:
    with pytest.raises(ValueError, match="'yarn'.*default, linear, llama3"):
        get_rope(16, 16, 64, 10000.0, {"rope_type": "yarn", "factor": 4.0})


def test_rope_parameters_read_classic_and_transformers5_keys() -> None:
    classic = {"rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_SCALING)}
    nested = {"rope_parameters": {**LLAMA3_SCALING, "rope_theta": 500000.0}}
    assert get_rope_parameters(classic) == get_rope_parameters(nested)
    assert get_rope_parameters(classic) == (500000.0, LLAMA3_SCALING, 1.0)
    partial = {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
        "partial_rotary_factor": 0.5,
    }
    assert get_rope_parameters(partial) == (10000.0, None, 0.5)


# ---------------------------------------------------------------------------------------------
# Merged linear layers


def test_qkv_loaded_from_separate_tensors_equals_separate_projections() -> None:
    hidden, head_dim, num_heads, num_kv_heads = 32, 8, 4, 2
    q_proj = nn.Linear(hidden, num_heads * head_dim)
    k_proj = nn.Linear(hidden, num_kv_heads * head_dim)
    v_proj = nn.Linear(hidden, num_kv_heads * head_dim)
    qkv = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, bias=True, prefix="qkv_proj")
    assert qkv.weight.shape == ((num_heads + 2 * num_kv_heads) * head_dim, hidden)
    for shard_id, proj in (("q", q_proj), ("k", k_proj), ("v", v_proj)):
        qkv.weight_loader(qkv.weight, proj.weight.detach(), shard_id)
        qkv.weight_loader(qkv.bias, proj.bias.detach(), shard_id)
    x = _randn(5, hidden)
    expected = torch.cat([q_proj(x), k_proj(x), v_proj(x)], dim=-1).detach()
    torch.testing.assert_close(qkv(x), expected)


class _StandInGroup:
    """A TP group of one process that believes it is ``rank`` of ``world_size``."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank_in_group, self.world_size = rank, world_size


@pytest.mark.parametrize(("num_kv_heads", "kv_head_of_rank"), [(2, [0, 1]), (1, [0, 0])])
def test_qkv_bias_shards_like_the_weight(monkeypatch, num_kv_heads, kv_head_of_rank) -> None:
    """Each rank's bias holds its query heads and its (split or replicated) KV heads."""
    from pieceworks.distributed import parallel_state

    hidden, head_dim, num_heads, tp_size = 32, 8, 4, 2
    biases = {
        "q": _randn(num_heads * head_dim),
        "k": _randn(num_kv_heads * head_dim),
        "v": _randn(num_kv_heads * head_dim),
    }
    for rank in range(tp_size):
        monkeypatch.setattr(parallel_state, "_TP", _StandInGroup(rank, tp_size))
        qkv = QKVParallelLinear(hidden, head_dim, num_heads, num_kv_heads, True, prefix="qkv")
        for shard_id, bias in biases.items():
            qkv.weight_loader(qkv.bias, bias, shard_id)
        q_size = num_heads // tp_size * head_dim
        kv_start = kv_head_of_rank[rank] * head_dim
        expected = torch.cat(
            [
                biases["q"][rank * q_size : (rank + 1) * q_size],
                biases["k"][kv_start : kv_start + head_dim],
                biases["v"][kv_start : kv_start + head_dim],
            ]
        )
        assert torch.equal(qkv.bias, expected)


def test_gate_up_loaded_from_separate_tensors_equals_hf_mlp() -> None:
    hidden, intermediate = 16, 24
    gate_proj, up_proj = (
        nn.Linear(hidden, intermediate, bias=False),
        nn.Linear(hidden, intermediate, bias=False),
    )
    gate_up = MergedColumnParallelLinear(hidden, [intermediate] * 2, prefix="gate_up_proj")
    gate_up.weight_loader(gate_up.weight, gate_proj.weight.detach(), 0)
    gate_up.weight_loader(gate_up.weight, up_proj.weight.detach(), 1)
    x = _randn(5, hidden)
    expected = (F.silu(gate_proj(x)) * up_proj(x)).detach()
    torch.testing.assert_close(silu_and_mul(gate_up(x)), expected)


def test_merged_weight_loader_names_the_mis_shaped_shard() -> None:
    qkv = QKVParallelLinear(32, 8, 4, 2, prefix="model.layers.0.self_attn.qkv_proj")
    with pytest.raises(weight_utils.WeightLoadingError) as error:
        qkv.weight_loader(qkv.weight, torch.zeros(8, 32), "k")
    assert "model.layers.0.self_attn.qkv_proj.weight shard 'k'" in str(error.value)
    assert "expected shape (16, 32), got (8, 32)" in str(error.value)
    gate_up = MergedColumnParallelLinear(32, [64, 64], prefix="mlp.gate_up_proj")
    with pytest.raises(weight_utils.WeightLoadingError, match=r"mlp.gate_up_proj.weight shard 1"):
        gate_up.weight_loader(gate_up.weight, torch.zeros(64, 31), 1)


# ---------------------------------------------------------------------------------------------
# Loader: a toy model with a merged weight and an optionally tied head, loaded like a Llama


class ToyForCausalLM(nn.Module):
    """Embedding -> merged gate/up MLP -> norm -> LM head, with vLLM's ``load_weights`` loop."""

    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
    stacked_params_mapping = [(".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]

    def __init__(self, tie_word_embeddings: bool = False) -> None:
        super().__init__()
        mlp = nn.ModuleDict(
            {
                "gate_up_proj": MergedColumnParallelLinear(
                    8, [12, 12], prefix="model.mlp.gate_up_proj"
                ),
                "down_proj": RowParallelLinear(12, 8, prefix="model.mlp.down_proj"),
            }
        )
        embed_tokens = VocabParallelEmbedding(20, 8, prefix="model.embed_tokens")
        self.model = nn.ModuleDict({"embed_tokens": embed_tokens, "mlp": mlp, "norm": RMSNorm(8)})
        self.model.rotary_emb = get_rope(4, 4, 16, 10000.0, None)
        self.lm_head = ParallelLMHead(20, 8, prefix="lm_head")
        if tie_word_embeddings:
            self.lm_head.tie_weights(embed_tokens)
        self.tie_word_embeddings = tie_word_embeddings

    def load_weights(self, weights):
        params_dict = dict(self.named_parameters())
        for checkpoint_name, tensor in weights:
            if weight_utils.is_ignored_tensor(checkpoint_name):
                continue
            name, shard_args = checkpoint_name, ()
            for param_name, weight_name, shard_id in self.stacked_params_mapping:
                if weight_name in checkpoint_name:
                    name, shard_args = checkpoint_name.replace(weight_name, param_name), (shard_id,)
                    break
            if name not in params_dict:
                raise weight_utils.unexpected_tensor_error(self, checkpoint_name)
            weight_utils.get_weight_loader(self, name)(params_dict[name], tensor, *shard_args)


def _toy_checkpoint(tie_word_embeddings: bool = False) -> dict[str, torch.Tensor]:
    shapes = {
        "model.embed_tokens.weight": (20, 8),
        "model.mlp.gate_proj.weight": (12, 8),
        "model.mlp.up_proj.weight": (12, 8),
        "model.mlp.down_proj.weight": (8, 12),
        "model.norm.weight": (8,),
    }
    if not tie_word_embeddings:
        shapes["lm_head.weight"] = (20, 8)
    return {name: _randn(*shape, seed=i) for i, (name, shape) in enumerate(shapes.items())}


def test_load_weights_stacks_merged_weights_and_skips_ignorable_tensors() -> None:
    model, checkpoint = ToyForCausalLM(), _toy_checkpoint()
    with_buffer = {**checkpoint, "model.rotary_emb.inv_freq": torch.ones(2)}
    loader.load_weights(model, with_buffer.items())
    gate_up = torch.cat(
        [checkpoint["model.mlp.gate_proj.weight"], checkpoint["model.mlp.up_proj.weight"]]
    )
    torch.testing.assert_close(model.model.mlp.gate_up_proj.weight, gate_up, rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head.weight, checkpoint["lm_head.weight"], rtol=0, atol=0)


def test_missing_tensors_are_listed_by_checkpoint_name() -> None:
    checkpoint = _toy_checkpoint()
    del checkpoint["model.mlp.up_proj.weight"], checkpoint["lm_head.weight"]
    with pytest.raises(weight_utils.WeightLoadingError, match="lacks 2 tensor") as error:
        loader.load_weights(ToyForCausalLM(), checkpoint.items())
    assert "lm_head.weight, model.mlp.up_proj.weight" in str(error.value)
    assert "gate_proj" not in str(error.value)


def test_tied_head_needs_no_lm_head_tensor() -> None:
    model = ToyForCausalLM(tie_word_embeddings=True)
    loader.load_weights(model, _toy_checkpoint(tie_word_embeddings=True).items())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_unexpected_tensor_is_named() -> None:
    checkpoint = {**_toy_checkpoint(), "model.mlp.extra_proj.weight": torch.zeros(3)}
    with pytest.raises(weight_utils.WeightLoadingError, match="'model.mlp.extra_proj.weight'"):
        loader.load_weights(ToyForCausalLM(), checkpoint.items())


@pytest.mark.parametrize(
    ("name", "expected"),
    [("model.mlp.up_proj.weight", (12, 8)), ("model.norm.weight", (8,))],
    ids=["stacked", "plain"],
)
def test_mis_shaped_tensor_names_tensor_expected_and_got(name: str, expected: tuple) -> None:
    checkpoint = {**_toy_checkpoint(), name: torch.zeros(7, 7)}
    with pytest.raises(weight_utils.WeightLoadingError) as error:
        loader.load_weights(ToyForCausalLM(), checkpoint.items())
    assert error.value.tensor_name == name
    assert f"{name!r}" in str(error.value)
    assert f"expected shape {expected}, got (7, 7)" in str(error.value)


@pytest.mark.parametrize("max_shard_bytes", [None, 1000], ids=["single", "sharded"])
def test_save_and_load_round_trip(tmp_path, max_shard_bytes: int | None) -> None:
    checkpoint = _toy_checkpoint()
    hf_directory.save_hf_directory(
        checkpoint, {"architectures": ["Toy"]}, tmp_path, max_shard_bytes=max_shard_bytes
    )
    files = hf_directory.hf_weight_files(tmp_path)
    if max_shard_bytes:
        index = json.loads((tmp_path / hf_directory.SAFE_WEIGHTS_INDEX_NAME).read_text())
        assert len(files) > 1 and set(index["weight_map"]) == set(checkpoint)
    else:
        assert [path.name for path in files] == [hf_directory.SAFE_WEIGHTS_NAME]
    assert hf_directory.load_hf_config(tmp_path) == {"architectures": ["Toy"]}
    read_back = dict(hf_directory.hf_weights_iterator(tmp_path))
    assert read_back.keys() == checkpoint.keys()
    for name, tensor in checkpoint.items():
        torch.testing.assert_close(read_back[name], tensor, rtol=0, atol=0)
    model = ToyForCausalLM()
    loader.load_weights(model, hf_directory.hf_weights_iterator(tmp_path))
    torch.testing.assert_close(model.model.norm.weight, checkpoint["model.norm.weight"])


def test_resaving_unsharded_removes_old_shards(tmp_path) -> None:
    checkpoint = _toy_checkpoint()
    hf_directory.save_hf_directory(checkpoint, {}, tmp_path, max_shard_bytes=1000)
    hf_directory.save_hf_directory(checkpoint, {}, tmp_path)
    assert [path.name for path in hf_directory.hf_weight_files(tmp_path)] == [
        hf_directory.SAFE_WEIGHTS_NAME
    ]


def test_directory_without_weights_or_config_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="safetensors"):
        hf_directory.hf_weight_files(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_directory.load_hf_config(tmp_path)


def test_meta_model_materialises_with_ties_and_buffers() -> None:
    with torch.device("meta"):
        model = ToyForCausalLM(tie_word_embeddings=True)
    loader.materialize_model(model, "cpu")
    assert not any(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    expected = get_rope(4, 4, 16, 10000.0, None).cos_sin_cache
    torch.testing.assert_close(model.model.rotary_emb.cos_sin_cache, expected, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Presets and registry


def test_unknown_preset_lists_the_names() -> None:
    with pytest.raises(ValueError) as error:
        presets.get_preset("llama-7b")
    for name in ("llama-tiny", "llama-125m", "llama-3.1-8b", "bamba-tiny", "bamba-9b"):
        assert name in str(error.value)
    assert presets.is_preset("llama-tiny") and not presets.is_preset("llama-7b")


def test_get_preset_returns_a_copy() -> None:
    presets.get_preset("llama-3.1-8b")["rope_scaling"]["factor"] = 1.0
    assert presets.get_preset("llama-3.1-8b")["rope_scaling"]["factor"] == 8.0


def test_llama_3_1_8b_preset_has_eight_billion_parameters() -> None:
    num_params = presets.num_parameters(presets.get_preset("llama-3.1-8b"))
    assert math.isclose(num_params, 8.03e9, rel_tol=1e-3)


@pytest.mark.parametrize("tie_word_embeddings", [True, False], ids=["tied", "untied"])
def test_llama_weight_specs_match_hf_state_dict(tie_word_embeddings: bool) -> None:
    hf_config = {**presets.get_preset("llama-tiny"), "tie_word_embeddings": tie_word_embeddings}
    hf_config["attention_bias"] = not tie_word_embeddings  # cover the bias names too
    config = transformers.LlamaConfig(**hf_config)
    state_dict = modeling_llama.LlamaForCausalLM(config).state_dict()
    if tie_word_embeddings:
        del state_dict["lm_head.weight"]  # HF saves tied checkpoints without it
    specs = presets.hf_weight_specs(hf_config)
    assert {name: spec.shape for name, spec in specs.items()} == {
        name: tuple(tensor.shape) for name, tensor in state_dict.items()
    }


def test_bamba_weight_specs_match_hf_state_dict() -> None:
    if importlib.util.find_spec("transformers.models.bamba") is None:
        pytest.skip("this transformers has no Bamba")
    from transformers import BambaConfig, BambaForCausalLM

    hf_config = presets.get_preset("bamba-tiny")
    state_dict = BambaForCausalLM(BambaConfig(**hf_config)).state_dict()
    specs = presets.hf_weight_specs(hf_config)
    assert {name: spec.shape for name, spec in specs.items()} == {
        name: tuple(tensor.shape) for name, tensor in state_dict.items()
    }


def test_qwen3_weight_specs_match_hf_state_dict() -> None:
    """The Qwen3-8B preset, shrunk: the random-weight recipe names HF's tensors and shapes."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hf_config = {
        **presets.get_preset("qwen3-8b"),
        **{"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2},
        **{"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 128},
    }
    state_dict = Qwen3ForCausalLM(Qwen3Config(**hf_config)).state_dict()
    specs = presets.hf_weight_specs(hf_config)
    assert {name: spec.shape for name, spec in specs.items()} == {
        name: tuple(tensor.shape) for name, tensor in state_dict.items()
    }


def test_gemma3_weight_specs_match_hf_state_dict() -> None:
    """The Gemma-3-4B preset, shrunk: HF's tensors and shapes; norms drawn near 0 for (1 + w)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    hf_config = {
        **presets.get_preset("gemma-3-4b"),
        **{"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "layer_types": None},
        **{"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 128},
    }
    state_dict = Gemma3ForCausalLM(Gemma3TextConfig(**hf_config)).state_dict()
    del state_dict["lm_head.weight"]  # tied: saved without it
    specs = presets.hf_weight_specs(hf_config)
    assert {name: spec.shape for name, spec in specs.items()} == {
        name: tuple(tensor.shape) for name, tensor in state_dict.items()
    }
    norms = {spec.init for name, spec in specs.items() if "norm" in name}
    assert norms == {"offset_norm"}


def test_random_checkpoint_is_seeded_and_loads_in_hf(tmp_path) -> None:
    from tests.models.hf_reference import build_hf_llama, hf_logits

    first = presets.random_hf_checkpoint(
        "llama-tiny", tmp_path / "a", seed=3, max_shard_bytes=50_000
    )
    second = presets.random_hf_checkpoint("llama-tiny", tmp_path / "b", seed=3)
    weights_a, weights_b = (
        dict(hf_directory.hf_weights_iterator(first)),
        dict(hf_directory.hf_weights_iterator(second)),
    )
    assert (
        weights_a.keys()
        == weights_b.keys()
        == set(presets.hf_weight_specs(presets.get_preset("llama-tiny")))
    )
    for name in weights_a:
        torch.testing.assert_close(weights_a[name], weights_b[name], rtol=0, atol=0)
    assert hf_directory.load_hf_config(first)["torch_dtype"] == "float32"
    hf_model = build_hf_llama(first)
    torch.testing.assert_close(
        hf_model.model.embed_tokens.weight, weights_a["model.embed_tokens.weight"], rtol=0, atol=0
    )
    logits = hf_logits(hf_model, [1, 5, 9, 200])
    assert logits.shape == (4, 256) and logits.abs().max() < 10  # random weights, sane scale


def test_registry_names_supported_architectures() -> None:
    with pytest.raises(ValueError) as error:
        registry.get_model_class({"architectures": ["GPT2LMHeadModel"]})
    assert "BambaForCausalLM" in str(error.value) and "LlamaForCausalLM" in str(error.value)
    assert registry.supported_architectures() == [
        "BambaForCausalLM",
        "Gemma3ForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "NemotronHForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3_5ForCausalLM",
    ]
    hybrids = ["BambaForCausalLM", "NemotronHForCausalLM", "Qwen3_5ForCausalLM"]
    assert [registry.is_hybrid({"architectures": [name]}) for name in hybrids] == [True] * 3
    assert not registry.is_hybrid({"architectures": ["Qwen3ForCausalLM"]})


# ---------------------------------------------------------------------------------------------
# LlamaForCausalLM loading (needs the attention layer, written separately)


def _llama_engine_config(model_dir):
    from pieceworks.config import CompilationConfig, EngineConfig, ModelConfig

    model_config = ModelConfig(
        model=str(model_dir), hf_config=hf_directory.load_hf_config(model_dir), dtype="float32"
    )
    return EngineConfig(model_config=model_config, compilation_config=CompilationConfig(level=0))


@pytest.mark.parametrize("tie_word_embeddings", [True, False], ids=["tied", "untied"])
def test_llama_loads_hf_checkpoint_into_merged_weights(tmp_path, tie_word_embeddings: bool) -> None:
    pytest.importorskip("pieceworks.models.attention.layer")
    hf_config = {**presets.get_preset("llama-tiny"), "tie_word_embeddings": tie_word_embeddings}
    presets.random_hf_checkpoint(hf_config, tmp_path, seed=0, max_shard_bytes=100_000)
    model = sources.get_model(_llama_engine_config(tmp_path), "cpu")
    weights = dict(hf_directory.hf_weights_iterator(tmp_path))
    attention = model.model.layers[1].self_attn
    qkv = torch.cat(
        [weights[f"model.layers.1.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]
    )
    torch.testing.assert_close(attention.qkv_proj.weight, qkv, rtol=0, atol=0)
    head = model.lm_head.weight
    assert (head is model.model.embed_tokens.weight) == tie_word_embeddings
    expected_head = weights[
        "model.embed_tokens.weight" if tie_word_embeddings else "lm_head.weight"
    ]
    torch.testing.assert_close(head, expected_head, rtol=0, atol=0)
    assert model.model.layers[0].self_attn.rotary_emb is attention.rotary_emb
