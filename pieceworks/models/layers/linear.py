"""Linear layers with vLLM's names and weight-loading contract.

``ReplicatedLinear`` holds a whole weight; ``ColumnParallelLinear`` splits the output dim and
``RowParallelLinear`` the input dim across tensor-parallel ranks; ``MergedColumnParallelLinear``
(gate/up) and ``QKVParallelLinear`` (q/k/v) stack several checkpoint tensors into one weight, so
one GEMM replaces two or three. Each layer's ``weight_loader(param, loaded_weight, shard_id)``
places one checkpoint tensor into its slice of the merged weight.

Tensor parallelism is not implemented yet: ``tensor_parallel_rank_and_size()`` is the one place
that says ``(0, 1)``. Sizes and loaders are already written per partition, so sharding only needs
that function and the all-reduce after ``RowParallelLinear``. ``forward`` returns the output tensor
alone (vLLM returns ``(output, output_bias)``). The GEMM and the post-load weight rewrite belong to
the layer's ``quant_method`` (``layers/quantization``): plain, or FP8 with ``quant_config``.
"""

from __future__ import annotations

import torch
from torch import nn

from pieceworks.models.layers.quantization import Fp8Config, LinearMethod, UnquantizedLinearMethod
from pieceworks.models.loader import copy_weight


def tensor_parallel_rank_and_size() -> tuple[int, int]:
    """``(tp_rank, tp_size)`` of this process; ``(0, 1)`` until tensor parallelism lands."""
    return 0, 1


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """Exact integer division; a clear error when the split is uneven."""
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by {denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    """``y = x W^T (+ b)`` with ``W (output_size_per_partition, input_size_per_partition)``."""

    def __init__(
        self,
        input_size_per_partition: int,
        output_size_per_partition: int,
        bias: bool = False,
        *,
        prefix: str = "",
        quant_config: Fp8Config | None = None,
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.quant_method: LinearMethod = (
            quant_config.get_linear_method() if quant_config else UnquantizedLinearMethod()
        )
        self.tp_rank, self.tp_size = tensor_parallel_rank_and_size()
        self.weight = nn.Parameter(
            torch.empty(output_size_per_partition, input_size_per_partition), requires_grad=False
        )
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size_per_partition), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)  # (T, out)

    def _param_name(self, param: nn.Parameter) -> str:
        suffix = "bias" if param is self.bias else "weight"
        return f"{self.prefix}.{suffix}" if self.prefix else suffix


class ReplicatedLinear(LinearBase):
    """A linear layer every rank holds whole."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        prefix: str = "",
        quant_config: Fp8Config | None = None,
    ) -> None:
        super().__init__(input_size, output_size, bias, prefix=prefix, quant_config=quant_config)
        self.input_size, self.output_size = input_size, output_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        copy_weight(param, loaded_weight, self._param_name(param))


class ColumnParallelLinear(LinearBase):
    """Output dim split across ranks: rank ``r`` holds output rows ``[r, r + 1) * out / tp``."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        prefix: str = "",
        quant_config: Fp8Config | None = None,
    ) -> None:
        tp_size = tensor_parallel_rank_and_size()[1]
        output_per_partition = divide(output_size, tp_size, f"{prefix} output_size")
        super().__init__(
            input_size, output_per_partition, bias, prefix=prefix, quant_config=quant_config
        )
        self.input_size, self.output_size = input_size, output_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        shard_size = param.shape[0]
        loaded_weight = self._rank_slice(loaded_weight, shard_size)
        copy_weight(param, loaded_weight, self._param_name(param))

    def _rank_slice(self, loaded_weight: torch.Tensor, shard_size: int) -> torch.Tensor:
        """This rank's rows of a full checkpoint tensor (all of it while tp_size is 1)."""
        if self.tp_size == 1:
            return loaded_weight
        return loaded_weight.narrow(0, self.tp_rank * shard_size, shard_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one weight (gate_proj and up_proj: shard ids 0 and 1)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        *,
        prefix: str = "",
        quant_config: Fp8Config | None = None,
    ) -> None:
        super().__init__(
            input_size, sum(output_sizes), bias, prefix=prefix, quant_config=quant_config
        )
        self.output_sizes = list(output_sizes)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: int | None = None
    ) -> None:
        if loaded_shard_id is None:  # the whole merged tensor
            copy_weight(param, loaded_weight, self._param_name(param))
            return
        if not 0 <= loaded_shard_id < len(self.output_sizes):
            raise ValueError(
                f"{self._param_name(param)}: shard id {loaded_shard_id} out of range "
                f"(it has {len(self.output_sizes)} shards)"
            )
        shard_offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        shard_size = self.output_sizes[loaded_shard_id] // self.tp_size
        destination = param.data.narrow(0, shard_offset, shard_size)
        loaded_weight = self._rank_slice(loaded_weight, shard_size)
        copy_weight(
            destination, loaded_weight, f"{self._param_name(param)} shard {loaded_shard_id}"
        )


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one weight ``((Hq + 2 * Hkv) * D, hidden)``.

    Shard ids ``"q"``, ``"k"``, ``"v"`` name HF's ``q_proj``, ``k_proj``, ``v_proj``.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = False,
        *,
        prefix: str = "",
        quant_config: Fp8Config | None = None,
    ) -> None:
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, output_size, bias, prefix=prefix, quant_config=quant_config)
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        # Tensor parallelism with tp_size > num_kv_heads would replicate kv heads (vLLM does).
        self.num_heads = divide(total_num_heads, self.tp_size, f"{prefix} num_heads")
        self.num_kv_heads = divide(total_num_kv_heads, self.tp_size, f"{prefix} num_kv_heads")

    def _shard_offset_and_size(self, shard_id: str) -> tuple[int, int]:
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        shards = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}
        if shard_id not in shards:
            raise ValueError(f"{self.prefix}: shard id {shard_id!r} is not one of 'q', 'k', 'v'")
        return shards[shard_id]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: str | None = None
    ) -> None:
        if loaded_shard_id is None:  # the whole merged tensor
            copy_weight(param, loaded_weight, self._param_name(param))
            return
        shard_offset, shard_size = self._shard_offset_and_size(loaded_shard_id)
        destination = param.data.narrow(0, shard_offset, shard_size)
        loaded_weight = self._rank_slice(loaded_weight, shard_size)
        copy_weight(
            destination, loaded_weight, f"{self._param_name(param)} shard {loaded_shard_id!r}"
        )


class RowParallelLinear(LinearBase):
    """Input dim split across ranks; with tensor parallelism the outputs are all-reduced."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        prefix: str = "",
        quant_config: Fp8Config | None = None,
    ) -> None:
        tp_size = tensor_parallel_rank_and_size()[1]
        input_per_partition = divide(input_size, tp_size, f"{prefix} input_size")
        super().__init__(
            input_per_partition, output_size, bias, prefix=prefix, quant_config=quant_config
        )
        self.input_size, self.output_size = input_size, output_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if self.tp_size > 1 and param is self.weight:
            shard_size = param.shape[1]
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * shard_size, shard_size)
        copy_weight(param, loaded_weight, self._param_name(param))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # With tensor parallelism: all-reduce the partial sums here, adding the bias once.
        return self.quant_method.apply(self, x, self.bias)  # (T, out)
