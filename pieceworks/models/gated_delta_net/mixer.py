"""``GatedDeltaNet`` (Qwen3.5's linear-attention layer) and its opaque op ``gated_delta_net``.

The layer keeps the projections, the decay and rate, the gated norm and ``out_proj`` in the
compiled pieces (plain ATen); between them the op
``pieceworks::gated_delta_net(projected_states, g, beta, output, layer_name)`` runs the stateful
core (causal conv over ``[q, k, v]``, then the gated delta rule, ``backend.py``) on the layer's
state slots and writes the core's output into ``output``. Like ``mamba_mixer2`` it is registered
with a fake implementation (tracing runs nothing) and ``dynamic=True``: its plan follows the
batch, so it is a splitting op (``CompilationConfig.splitting_ops``' default), PIECEWISE graphs
capture around it, breakable graphs break at it, and a FULL decode graph holds its decode path.
Semantics are transformers' ``Qwen3_5GatedDeltaNet``: ``in_proj_qkv``, ``in_proj_z``,
``in_proj_b`` and ``in_proj_a`` (one merged GEMM here, ``in_proj``),
``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``, q and k L2-normalised in the
core, then ``out_proj(norm(core) * silu(z))`` with the RMS norm taken per value head (norm before
gate). The delta rule's implementations (the ops ``chunk_gated_delta_rule`` and
``recurrent_gated_delta_rule``) and the conv's (``causal_conv1d_update`` and
``causal_conv1d_varlen``) come from the engine's kernel chooser (``choose_kernels``).
Tensor parallelism is not implemented for this layer: a tensor-parallel size above one is
refused when it is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.core.forward_context import get_forward_context
from pieceworks.distributed.parallel_state import tensor_parallel_rank_and_size
from pieceworks.kernels.gated_delta_rule import torch_state_slots
from pieceworks.models.attention.metadata import AttentionMetadata
from pieceworks.models.gated_delta_net.backend import (
    GatedDeltaNetBackend,
    GatedDeltaNetParams,
    conv_update_torch,
)
from pieceworks.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pieceworks.models.mamba.ops import causal_conv1d_ref

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig
    from pieceworks.kernels.chooser import KernelChooser


def gated_delta_net(
    projected_states: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    context = get_forward_context()
    layer = context.no_compile_layers[layer_name]
    layer.mix(projected_states, g, beta, output, context.attn_metadata)


def gated_delta_net_fake(
    projected_states: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    output: torch.Tensor,
    layer_name: str,
) -> None:
    return None


def gated_delta_net_op():
    """``torch.ops.pieceworks.gated_delta_net``, registered on first use."""
    return direct_register_custom_op(
        "gated_delta_net",
        gated_delta_net,
        mutates_args=["output"],
        fake_impl=gated_delta_net_fake,
        dynamic=True,  # its plan follows the batch: a splitting op wherever pieces are captured
    )


class ConvWeight(nn.Module):
    """The depthwise conv's weight, HF layout ``(conv_dim, 1, d_conv)``; the op applies it."""

    def __init__(self, conv_dim: int, kernel_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(conv_dim, 1, kernel_size), requires_grad=False)


class HeadRMSNormGated(nn.Module):
    """``(weight * rmsnorm(y)) * silu(gate)``, the RMS taken over each head's ``head_dim``
    (transformers' ``Qwen3_5RMSNormGated``: norm before gate)."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.head_dim, self.variance_epsilon = head_dim, eps
        self.weight = nn.Parameter(torch.ones(head_dim), requires_grad=False)

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        heads = y.float().unflatten(-1, (-1, self.head_dim))  # (T, H, D)
        normed = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        normed = self.weight * normed.to(y.dtype)
        gated = normed * F.silu(gate.float().unflatten(-1, (-1, self.head_dim)))
        return gated.to(y.dtype).flatten(-2)  # (T, H * D)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet over flattened tokens; its state slots are bound later by the runner.

    ``mamba_cache`` (the state-slot cache's name for every recurrent layer,
    ``worker/mamba_cache.py``) is ``(conv_state (num_slots, conv_dim, d_conv - 1),
    recurrent_state (num_slots, Hv, Dk, Dv))``, indexed by ``metadata.state_indices``; slot 0 is
    the null slot.
    """

    def __init__(self, hf_config: dict[str, Any], *, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        if tensor_parallel_rank_and_size()[1] > 1:
            raise ValueError(
                f"{prefix}: tensor parallelism is not implemented for Gated DeltaNet layers; "
                "use tensor_parallel_size=1"
            )
        hidden_size = hf_config["hidden_size"]
        self.num_k_heads = hf_config["linear_num_key_heads"]
        self.num_v_heads = hf_config["linear_num_value_heads"]
        self.head_k_dim = hf_config["linear_key_head_dim"]
        self.head_v_dim = hf_config["linear_value_head_dim"]
        self.conv_kernel_size = hf_config["linear_conv_kernel_dim"]
        key_dim, self.value_dim = (
            self.num_k_heads * self.head_k_dim,
            self.num_v_heads * self.head_v_dim,
        )
        self.conv_dim = 2 * key_dim + self.value_dim
        # shard ids 0-3: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
        self.split_sizes = [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads]
        self.in_proj = MergedColumnParallelLinear(
            hidden_size, self.split_sizes, False, prefix=f"{prefix}.in_proj"
        )
        self.conv1d = ConvWeight(self.conv_dim, self.conv_kernel_size)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.norm = HeadRMSNormGated(self.head_v_dim, hf_config["rms_norm_eps"])
        self.out_proj = RowParallelLinear(
            self.value_dim, hidden_size, False, prefix=f"{prefix}.out_proj"
        )
        self.layer_name = prefix
        self.backend = GatedDeltaNetBackend
        self.chunk_kernel = torch_state_slots.chunk_gated_delta_rule_varlen  # until chosen
        self.recurrent_kernel = torch_state_slots.recurrent_gated_delta_rule_slots
        self.conv_update_kernel = conv_update_torch
        self.conv_varlen_kernel = causal_conv1d_ref
        self.mamba_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.op = gated_delta_net_op()
        config.compilation_config.register_layer(prefix, self)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        projected_states = self.in_proj(hidden_states)  # (T, conv_dim + Hv * Dv + 2 Hv)
        _, z, b, a = projected_states.split(self.split_sizes, dim=-1)
        beta = b.sigmoid()  # (T, Hv): how much of each token the state takes in
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (T, Hv) log decay
        output = hidden_states.new_empty((hidden_states.shape[0], self.value_dim))
        self.op(projected_states, g, beta, output, self.layer_name)  # (T, Hv * Dv)
        return self.out_proj(self.norm(output, z))  # (T, hidden)

    def mix(
        self,
        projected_states: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        output: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None:
        """The op's body: conv + delta rule over the state slots, written into ``output``."""
        if self.mamba_cache is None:
            raise RuntimeError(
                f"{self.layer_name}: no state cache bound; the model runner binds caches before "
                "the first forward"
            )
        mixed_qkv = projected_states[:, : self.conv_dim]
        self.backend.forward(mixed_qkv, g, beta, output, self.mamba_cache, self.params(), metadata)

    def choose_kernels(self, kernels: KernelChooser) -> None:
        """The delta rule's two implementations for this layer's dtype and key head size, and
        the conv's two for its dtype (a ``torch`` choice leaves the layer's torch form)."""
        dtype = self.norm.weight.dtype  # the model dtype: q, k and v are in it
        chosen = {
            op: kernels.choose(op, dtype=dtype, head_size=self.head_k_dim).impl.fn
            for op in ("chunk_gated_delta_rule", "recurrent_gated_delta_rule")
        }
        chosen.update(
            (op, kernels.choose(op, dtype=dtype).impl.fn)
            for op in ("causal_conv1d_update", "causal_conv1d_varlen")
        )
        self.chunk_kernel = (
            chosen["chunk_gated_delta_rule"] or torch_state_slots.chunk_gated_delta_rule_varlen
        )
        self.recurrent_kernel = (
            chosen["recurrent_gated_delta_rule"]
            or torch_state_slots.recurrent_gated_delta_rule_slots
        )
        self.conv_update_kernel = chosen["causal_conv1d_update"] or conv_update_torch
        self.conv_varlen_kernel = chosen["causal_conv1d_varlen"] or causal_conv1d_ref

    def params(self) -> GatedDeltaNetParams:
        return GatedDeltaNetParams(
            conv_weight=self.conv1d.weight[:, 0],  # (conv_dim, d_conv)
            num_k_heads=self.num_k_heads,
            num_v_heads=self.num_v_heads,
            head_k_dim=self.head_k_dim,
            head_v_dim=self.head_v_dim,
            chunk_kernel=self.chunk_kernel,
            recurrent_kernel=self.recurrent_kernel,
            conv_update_kernel=self.conv_update_kernel,
            conv_varlen_kernel=self.conv_varlen_kernel,
        )

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-slot shapes of the conv state and the recurrent state."""
        conv_shape = (self.conv_dim, self.conv_kernel_size - 1)
        return conv_shape, (self.num_v_heads, self.head_k_dim, self.head_v_dim)
