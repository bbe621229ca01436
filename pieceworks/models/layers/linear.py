"""Linear layers with vLLM's names and weight-loading contract, sharded across TP ranks.

``ReplicatedLinear`` holds a whole weight; ``ColumnParallelLinear`` splits the output dim and
``RowParallelLinear`` the input dim across tensor-parallel ranks; ``MergedColumnParallelLinear``
(gate/up) and ``QKVParallelLinear`` (q/k/v) stack several checkpoint tensors into one weight, so
one GEMM replaces two or three, and shard each stacked piece separately. Each layer's
``weight_loader(param, loaded_weight, shard_id)`` takes one whole checkpoint tensor and places
this rank's slice of it into its part of the weight.

Layers read ``tensor_parallel_rank_and_size()`` (``pieceworks.distributed``) once, at
construction; it is ``(0, 1)`` without tensor parallelism. ``RowParallelLinear`` sums its partial
outputs with ``tensor_model_parallel_all_reduce``, the traced custom op (see
``docs/parallel.md``). ``forward`` returns the output tensor alone (vLLM returns ``(output,
output_bias)``). The GEMM and the post-load weight rewrite belong to the layer's
``quant_method`` (``layers/quantization``): plain, or FP8 with ``quant_config``.
"""

from __future__ import annotations

import torch
from torch import nn

from pieceworks.distributed.communication_op import tensor_model_parallel_all_reduce
from pieceworks.distributed.parallel_state import tensor_parallel_rank_and_size
from pieceworks.models.layers.quantization import Fp8Config, LinearMethod, UnquantizedLinearMethod
from pieceworks.models.loading.weight_utils import check_shape, copy_weight, shard_rows


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    """``numerator`` split over ``denominator`` ranks; a ValueError saying what to change."""
    if numerator % denominator:
        raise ValueError(
            f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}; pick a "
            "tensor_parallel_size that divides it"
        )
    return numerator // denominator


def shard_or_replicate(total: int, tp_rank: int, tp_size: int, what: str) -> tuple[int, int]:
    """``(first, count)`` of the heads (or groups) that rank ``tp_rank`` holds.

    At least one per rank: split, ``total / tp_size`` each (must divide). Fewer than ranks: one
    each, replicated on ``tp_size / total`` consecutive ranks (must divide; vLLM's KV-head rule),
    so rank ``r`` holds ``r * total // tp_size``.
    """
    if total >= tp_size:
        count = divide(total, tp_size, what)
        return tp_rank * count, count
    if tp_size % total:
        raise ValueError(
            f"{what}={total} is below tensor_parallel_size={tp_size} and does not divide it, so "
            f"it can neither be split nor replicated evenly; pick a tensor_parallel_size that "
            f"divides {total} or is a multiple of it"
        )
    return tp_rank * total // tp_size, 1


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
        full_shape = (self.output_size, *param.shape[1:])
        name = self._param_name(param)
        rows = [(self.tp_rank * shard_size, shard_size)]
        copy_weight(param, shard_rows(loaded_weight, full_shape, rows, name), name)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one weight (gate_proj and up_proj: shard ids 0 and 1).

    Each piece is split on its own: rank ``r`` holds ``[gate_r, up_r]``, not a slice of the stack.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        *,
        prefix: str = "",
        quant_config: Fp8Config | None = None,
    ) -> None:
        tp_size = tensor_parallel_rank_and_size()[1]
        for output_size in output_sizes:
            divide(output_size, tp_size, f"{prefix} output size")
        super().__init__(
            input_size, sum(output_sizes), bias, prefix=prefix, quant_config=quant_config
        )
        self.output_sizes = list(output_sizes)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: int | None = None
    ) -> None:
        if loaded_shard_id is None:  # the whole merged tensor: load it piece by piece
            check_shape(
                loaded_weight, (self.output_size, *param.shape[1:]), self._param_name(param)
            )
            for shard_id, piece in enumerate(loaded_weight.split(self.output_sizes)):
                self.weight_loader(param, piece, shard_id)
            return
        if not 0 <= loaded_shard_id < len(self.output_sizes):
            raise ValueError(
                f"{self._param_name(param)}: shard id {loaded_shard_id} out of range "
                f"(it has {len(self.output_sizes)} shards)"
            )
        shard_offset = sum(self.output_sizes[:loaded_shard_id]) // self.tp_size
        shard_size = self.output_sizes[loaded_shard_id] // self.tp_size
        destination = param.data.narrow(0, shard_offset, shard_size)
        full_shape = (self.output_sizes[loaded_shard_id], *param.shape[1:])
        name = f"{self._param_name(param)} shard {loaded_shard_id}"
        rows = [(self.tp_rank * shard_size, shard_size)]
        copy_weight(destination, shard_rows(loaded_weight, full_shape, rows, name), name)


class QKVParallelLinear(ColumnParallelLinear):
    """Query, key and value projections in one weight ``((Hq + 2 * Hkv) * D, hidden)`` per rank.

    Shard ids ``"q"``, ``"k"``, ``"v"`` name HF's ``q_proj``, ``k_proj``, ``v_proj``. Query heads
    are split across ranks; KV heads too when there are at least as many as ranks, else each rank
    holds one KV head, replicated on ``num_kv_head_replicas = tp / total_num_kv_heads`` ranks
    (rank ``r`` holds head ``r * total_num_kv_heads // tp``).
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
        tp_rank, tp_size = tensor_parallel_rank_and_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        kv_head_start, num_kv_heads = shard_or_replicate(
            total_num_kv_heads, tp_rank, tp_size, "num_key_value_heads"
        )
        # The parent divides by tp_size: pass tp_size times this rank's rows (KV replicas included).
        output_size = (num_heads + 2 * num_kv_heads) * head_size * tp_size
        super().__init__(hidden_size, output_size, bias, prefix=prefix, quant_config=quant_config)
        self.num_heads, self.num_kv_heads, self.kv_head_start = (
            num_heads,
            num_kv_heads,
            kv_head_start,
        )
        self.num_kv_head_replicas = max(1, tp_size // total_num_kv_heads)
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads

    def _shard_layout(self, shard_id: str) -> tuple[int, int, int, int]:
        """(offset in the weight, rows, first checkpoint row, checkpoint rows) of one shard."""
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        kv_start = self.kv_head_start * self.head_size
        kv_total = self.total_num_kv_heads * self.head_size
        layouts = {
            "q": (0, q_size, self.tp_rank * q_size, self.total_num_heads * self.head_size),
            "k": (q_size, kv_size, kv_start, kv_total),
            "v": (q_size + kv_size, kv_size, kv_start, kv_total),
        }
        if shard_id not in layouts:
            raise ValueError(f"{self.prefix}: shard id {shard_id!r} is not one of 'q', 'k', 'v'")
        return layouts[shard_id]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: str | None = None
    ) -> None:
        if loaded_shard_id is None:  # the whole merged tensor: load it piece by piece
            sizes = [self._shard_layout(shard_id)[3] for shard_id in "qkv"]
            check_shape(loaded_weight, (sum(sizes), *param.shape[1:]), self._param_name(param))
            for shard_id, piece in zip("qkv", loaded_weight.split(sizes)):
                self.weight_loader(param, piece, shard_id)
            return
        offset, size, checkpoint_start, checkpoint_size = self._shard_layout(loaded_shard_id)
        destination = param.data.narrow(0, offset, size)
        name = f"{self._param_name(param)} shard {loaded_shard_id!r}"
        full_shape = (checkpoint_size, *param.shape[1:])
        shard = shard_rows(loaded_weight, full_shape, [(checkpoint_start, size)], name)
        copy_weight(destination, shard, name)


class RowParallelLinear(LinearBase):
    """Input dim split across ranks; each rank's partial product is summed by an all-reduce.

    The bias is added once, on rank 0 before the sum. ``reduce_results=False`` leaves the
    partial sums to the caller.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        reduce_results: bool = True,
        prefix: str = "",
        quant_config: Fp8Config | None = None,
    ) -> None:
        tp_size = tensor_parallel_rank_and_size()[1]
        input_per_partition = divide(input_size, tp_size, f"{prefix} input_size")
        super().__init__(
            input_per_partition, output_size, bias, prefix=prefix, quant_config=quant_config
        )
        self.input_size, self.output_size = input_size, output_size
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        name = self._param_name(param)
        if param is self.weight:  # (out, in / tp): this rank's columns
            shard_size = param.shape[1]
            rows = [(self.tp_rank * shard_size, shard_size)]
            full_shape = (self.output_size, self.input_size)
            loaded_weight = shard_rows(loaded_weight, full_shape, rows, name, dim=1)
        copy_weight(param, loaded_weight, name)  # the bias is replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.quant_method.apply(self, x, self.bias)  # (T, out)
        bias = self.bias if self.tp_rank == 0 else None
        output = self.quant_method.apply(self, x, bias)  # (T, out): this rank's partial sum
        return tensor_model_parallel_all_reduce(output) if self.reduce_results else output
