"""``MambaMixer2`` and its opaque op ``mamba_mixer2``: the Mamba2 split point, like attention.

The layer keeps ``in_proj``, the gated RMSNorm and ``out_proj`` in the compiled pieces (plain
ATen); between them the op ``pieceworks::mamba_mixer2(projected_states, output, layer_name)``
runs the stateful core (causal conv1d, then the selective scan) on the layer's state cache and
writes y into ``output``. The layer registers itself by prefix at construction, so the op finds it
and the step's metadata in the forward context; the op's fake implementation does nothing, so
tracing runs no kernel. Semantics are HF transformers' ``BambaMixer``: ``in_proj`` output splits
into (gate z, conv input xBC, dt), xBC splits after the conv into (x, B, C), ``D`` skips x into y,
and the norm gates y with ``silu(z)`` before normalising within each of ``mamba_n_groups`` groups.
With tensor parallelism each rank holds ``mamba_n_heads / tp`` heads and their groups
(``mamba/sharding.py``); where a norm group spans several ranks the norm sums its squares across
them, and ``out_proj`` all-reduces its output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pieceworks.core.custom_op import direct_register_custom_op
from pieceworks.core.forward_context import get_forward_context
from pieceworks.distributed.communication_op import tensor_model_parallel_all_reduce
from pieceworks.distributed.parallel_state import tensor_parallel_rank_and_size
from pieceworks.models.attention.metadata import AttentionMetadata
from pieceworks.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from pieceworks.models.loading.weight_utils import copy_weight, shard_rows
from pieceworks.models.mamba.backends import Mamba2Params, MambaBackend
from pieceworks.models.mamba.ops import gated_rms_norm_ref
from pieceworks.models.mamba.sharding import Mamba2Sharding, Rows
from pieceworks.platforms import current_platform

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig


def mamba_mixer2(projected_states: torch.Tensor, output: torch.Tensor, layer_name: str) -> None:
    context = get_forward_context()
    layer = context.no_compile_layers[layer_name]
    layer.mix(projected_states, output, context.attn_metadata)


def mamba_mixer2_fake(
    projected_states: torch.Tensor, output: torch.Tensor, layer_name: str
) -> None:
    return None


def mamba_mixer2_op():
    """``torch.ops.pieceworks.mamba_mixer2``, registered on first use."""
    return direct_register_custom_op(
        "mamba_mixer2",
        mamba_mixer2,
        mutates_args=["output"],
        fake_impl=mamba_mixer2_fake,
        dynamic=True,  # its plan follows the batch: a splitting op wherever pieces are captured
    )


class MambaInProj(ColumnParallelLinear):
    """``in_proj``: this rank's rows of each of its parts (``Mamba2Sharding.in_proj_rows``)."""

    def __init__(self, hidden_size: int, sharding: Mamba2Sharding, bias: bool, *, prefix: str):
        output_size = sharding.local_in_proj_size * sharding.tp_size  # the parent divides by tp
        super().__init__(hidden_size, output_size, bias, prefix=prefix)
        self.output_size, self.rows = sharding.in_proj_size, sharding.in_proj_rows()

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        name = self._param_name(param)
        full_shape = (self.output_size, *param.shape[1:])
        copy_weight(param, shard_rows(loaded_weight, full_shape, self.rows, name), name)


class MambaConv1d(nn.Module):
    """The depthwise conv's weights, HF layout ``(conv_dim, 1, d_conv)``; the op applies them."""

    def __init__(
        self, sharding: Mamba2Sharding, kernel_size: int, bias: bool, *, prefix: str
    ) -> None:
        super().__init__()
        self.prefix, self.conv_dim = prefix, sharding.conv_dim
        self.rows: Rows = sharding.conv_rows()  # this rank's channels of [x, B, C]
        conv_dim = sharding.local_conv_dim
        self.weight = nn.Parameter(torch.empty(conv_dim, 1, kernel_size), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(conv_dim), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        name = f"{self.prefix}.{'bias' if param is self.bias else 'weight'}"
        full_shape = (self.conv_dim, *param.shape[1:])
        copy_weight(param, shard_rows(loaded_weight, full_shape, self.rows, name), name)


class MixerRMSNormGated(nn.Module):
    """``weight * rmsnorm(y * silu(gate))``, statistics per group (HF ``BambaRMSNormGated``).

    A group is ``I / G`` channels. When a rank holds whole groups the norm is local; when a group
    spans ``tp / G`` ranks (G < tp: one group per rank), each rank's sum of squares goes into its
    group's column of a ``(T, G)`` tensor that is all-reduced over the TP group.
    """

    def __init__(self, sharding: Mamba2Sharding, eps: float, *, prefix: str) -> None:
        super().__init__()
        self.variance_epsilon, self.prefix = eps, prefix
        self.num_groups, self.num_local_groups = sharding.num_groups, sharding.num_local_groups
        self.group_start = sharding.group_start
        self.group_size = sharding.intermediate_size // sharding.num_groups
        self.spans_ranks = sharding.norm_group_spans_ranks
        self.intermediate_size, self.rows = sharding.intermediate_size, sharding.intermediate_rows()
        self.weight = nn.Parameter(
            torch.ones(sharding.local_intermediate_size), requires_grad=False
        )

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if not self.spans_ranks:
            eps, num_groups = self.variance_epsilon, self.num_local_groups
            return gated_rms_norm_ref(y, gate, self.weight, eps, num_groups)
        hidden = y.float() * F.silu(gate.float())  # (T, I / tp)
        sum_squares = hidden.pow(2).sum(-1, keepdim=True)  # (T, 1): this rank's share
        before, after = self.group_start, self.num_groups - self.group_start - 1
        per_group = tensor_model_parallel_all_reduce(F.pad(sum_squares, (before, after)))  # (T, G)
        variance = per_group[:, self.group_start : self.group_start + 1] / self.group_size
        normed = hidden * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * normed.to(y.dtype)  # (T, I / tp)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        name = f"{self.prefix}.weight"
        copy_weight(
            param, shard_rows(loaded_weight, (self.intermediate_size,), self.rows, name), name
        )


def mamba_head_dim(hf_config: dict[str, Any]) -> int:
    """``mamba_d_head``, where HF's ``"auto"`` means ``mamba_expand * hidden / mamba_n_heads``."""
    head_dim = hf_config["mamba_d_head"]
    if head_dim == "auto":
        intermediate = int(hf_config["mamba_expand"] * hf_config["hidden_size"])
        return intermediate // hf_config["mamba_n_heads"]
    return int(head_dim)


class MambaMixer2(nn.Module):
    """Mamba2 mixer over flattened tokens; the state cache is bound later by the runner.

    ``mamba_cache`` is ``(conv_state (num_slots, conv_dim, d_conv - 1), ssm_state (num_slots,
    nheads, headdim, dstate))``, indexed by ``metadata.state_indices``; slot 0 is the null slot.
    """

    A: torch.Tensor  # (nheads,) float32 buffer

    def __init__(self, hf_config: dict[str, Any], *, config: EngineConfig, prefix: str) -> None:
        super().__init__()
        hidden_size = hf_config["hidden_size"]
        num_heads, head_dim = hf_config["mamba_n_heads"], mamba_head_dim(hf_config)
        intermediate_size = round(hf_config["mamba_expand"] * hidden_size)
        if num_heads * head_dim != intermediate_size:
            raise ValueError(
                f"{prefix}: mamba_n_heads {num_heads} * mamba_d_head {head_dim} must "
                f"equal mamba_expand * hidden_size = {intermediate_size}; fix config.json"
            )
        self.sharding = Mamba2Sharding(
            num_heads,
            head_dim,
            hf_config["mamba_n_groups"],
            hf_config["mamba_d_state"],
            *tensor_parallel_rank_and_size(),
        )
        # From here on every size is this rank's (all of it at tp 1).
        self.num_heads, self.head_dim = self.sharding.num_local_heads, head_dim
        self.intermediate_size = self.sharding.local_intermediate_size
        self.num_groups = self.sharding.num_local_groups
        self.state_size = hf_config["mamba_d_state"]
        self.conv_kernel_size = hf_config["mamba_d_conv"]
        self.conv_dim = self.sharding.local_conv_dim
        proj_bias = hf_config["mamba_proj_bias"]
        self.in_proj = MambaInProj(
            hidden_size, self.sharding, proj_bias, prefix=f"{prefix}.in_proj"
        )
        self.conv1d = MambaConv1d(
            self.sharding,
            self.conv_kernel_size,
            hf_config["mamba_conv_bias"],
            prefix=f"{prefix}.conv1d",
        )
        self.A_log = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads), requires_grad=False)
        # -exp(A_log) in float32, filled when A_log is loaded (HF recomputes it every call).
        self.register_buffer(
            "A", torch.empty(self.num_heads, dtype=torch.float32), persistent=False
        )
        self.norm = MixerRMSNormGated(
            self.sharding, hf_config["rms_norm_eps"], prefix=f"{prefix}.norm"
        )
        self.out_proj = RowParallelLinear(
            self.sharding.intermediate_size, hidden_size, proj_bias, prefix=f"{prefix}.out_proj"
        )
        time_step_limit = hf_config.get("time_step_limit") or (0.0, float("inf"))
        self.dt_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.layer_name = prefix
        self.backend: type[MambaBackend] = current_platform().mamba_backend()
        self.mamba_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.op = mamba_mixer2_op()
        config.compilation_config.register_layer(prefix, self)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        projected_states = self.in_proj(hidden_states)  # (T, I + conv_dim + H): z, xBC, dt
        output = hidden_states.new_empty((hidden_states.shape[0], self.intermediate_size))
        self.op(projected_states, output, self.layer_name)  # (T, I)
        gate = projected_states[:, : self.intermediate_size]
        return self.out_proj(self.norm(output, gate))  # (T, hidden)

    def mix(
        self, projected_states: torch.Tensor, output: torch.Tensor, metadata: AttentionMetadata
    ) -> None:
        """The op's body: conv + SSM over the state cache, y written into ``output``."""
        if self.mamba_cache is None:
            raise RuntimeError(
                f"{self.layer_name}: no Mamba state cache bound; the model runner binds "
                "caches before the first forward"
            )
        xBC_end = self.intermediate_size + self.conv_dim
        xBC = projected_states[:, self.intermediate_size : xBC_end]  # (T, conv_dim)
        dt = projected_states[:, xBC_end:]  # (T, H)
        self.backend.forward(xBC, dt, output, self.mamba_cache, self.params(), metadata)

    def params(self) -> Mamba2Params:
        return Mamba2Params(
            conv_weight=self.conv1d.weight[:, 0],  # (conv_dim, d_conv)
            conv_bias=self.conv1d.bias,
            A=self.A,
            D=self.D,
            dt_bias=self.dt_bias,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            num_groups=self.num_groups,
            state_size=self.state_size,
            dt_limit=self.dt_limit,
        )

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-slot shapes of the conv state and the SSM state."""
        conv_shape = (self.conv_dim, self.conv_kernel_size - 1)
        return conv_shape, (self.num_heads, self.head_dim, self.state_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Loader of ``A_log``, ``D`` and ``dt_bias`` (this rank's heads); ``A_log`` fills ``A``."""
        name = next(key for key, value in self._parameters.items() if value is param)
        name = f"{self.layer_name}.{name}"
        full_shape = (self.sharding.num_heads,)
        copy_weight(
            param, shard_rows(loaded_weight, full_shape, self.sharding.head_rows(), name), name
        )
        if param is self.A_log:
            with torch.no_grad():
                self.A.copy_(-torch.exp(param.float()))
