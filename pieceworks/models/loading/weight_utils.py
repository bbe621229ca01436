"""The weight-loading contract and the checks on checkpoint tensors.

A model's ``load_weights`` maps HF names to its parameters (vLLM style) and hands each tensor to
the owning module's ``weight_loader`` (``get_weight_loader``; ``default_weight_loader`` copies
whole). With tensor parallelism every rank reads the whole checkpoint and each sharded layer's
loader keeps its rank's slice (``shard_rows``, which checks the unsharded shape first). Every
mismatch is a ``WeightLoadingError`` naming the tensor: a wrong shape (``check_shape``), a tensor
the model has no place for (``unexpected_tensor_error``), a non-float dtype
(``check_checkpoint_dtype``). Reads no files and knows no model's names; ``loader.py`` drives a
whole load with these.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# Buffers some HF checkpoints carry that pieceworks recomputes (vLLM skips the same names).
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class WeightLoadingError(ValueError):
    """A checkpoint does not fit the model: a missing, unexpected or mis-shaped tensor."""

    def __init__(self, message: str, tensor_name: str | None = None) -> None:
        super().__init__(message)
        self.tensor_name = tensor_name


def check_shape(loaded_weight: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    """A ``WeightLoadingError`` naming the tensor unless ``loaded_weight`` has ``shape``."""
    if tuple(loaded_weight.shape) != tuple(shape):
        raise WeightLoadingError(
            f"{name}: expected shape {tuple(shape)}, got {tuple(loaded_weight.shape)}"
        )


def copy_weight(destination: torch.Tensor, loaded_weight: torch.Tensor, name: str) -> None:
    """Copy ``loaded_weight`` into ``destination`` (casting dtype and device), checking shape."""
    check_shape(loaded_weight, tuple(destination.shape), name)
    with torch.no_grad():
        destination.copy_(loaded_weight)


def shard_rows(
    loaded_weight: torch.Tensor,
    full_shape: tuple[int, ...],
    rows: list[tuple[int, int]],
    name: str,
    dim: int = 0,
) -> torch.Tensor:
    """This rank's slice of a whole checkpoint tensor: ``(start, length)`` ranges along ``dim``.

    The tensor must have the unsharded ``full_shape`` (checked first, so a mis-shaped tensor is a
    ``WeightLoadingError`` naming it, not an indexing error); the ranges are concatenated in order.
    """
    check_shape(loaded_weight, full_shape, name)
    pieces = [loaded_weight.narrow(dim, start, length) for start, length in rows]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Whole-tensor copy for parameters whose module has no ``weight_loader`` of its own.

    With tensor parallelism these are the replicated parameters (norms): every rank loads all of
    it. Every sharded parameter's module has a ``weight_loader`` that slices the rank's part.
    """
    copy_weight(param, loaded_weight, "parameter")


def get_weight_loader(model: nn.Module, param_name: str) -> Callable[..., None]:
    """The owning module's ``weight_loader``, else ``default_weight_loader``.

    vLLM hangs loaders on the parameters; ``to_empty`` replaces parameters (dropping their
    attributes), so here the loader is looked up on the module instead.
    """
    module_name = param_name.rpartition(".")[0]
    module = model.get_submodule(module_name) if module_name else model
    return getattr(module, "weight_loader", default_weight_loader)


def is_ignored_tensor(name: str) -> bool:
    """Checkpoint tensors that are derived buffers, not weights (e.g. ``rotary_emb.inv_freq``)."""
    return name.endswith(IGNORED_TENSOR_SUFFIXES)


def unexpected_tensor_error(model: nn.Module, name: str) -> WeightLoadingError:
    """The error a model's ``load_weights`` raises for a checkpoint tensor it has no place for."""
    return WeightLoadingError(
        f"unexpected checkpoint tensor {name!r}: {type(model).__name__} has no parameter for it "
        "(does config.json's 'architectures' match the checkpoint?)",
        tensor_name=name,
    )


def preview_names(names: list[str], limit: int = 20) -> str:
    """The first ``limit`` names, comma-separated, and how many more there are."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... and {len(names) - limit} more"


def check_checkpoint_dtype(name: str, tensor: torch.Tensor) -> None:
    """A ``WeightLoadingError`` naming the tensor unless its dtype is floating point.

    An integer or bool tensor (a quantized checkpoint's packed ints, a mask) would otherwise be
    cast silently into the float parameter. Reads no data.
    """
    if not tensor.is_floating_point():
        raise WeightLoadingError(
            f"checkpoint tensor {name!r} has dtype {str(tensor.dtype).removeprefix('torch.')}, "
            "not a floating-point dtype; pieceworks loads float32 / bfloat16 / float16 "
            "checkpoints (a quantized checkpoint, e.g. GPTQ or AWQ, is not supported: load the "
            "unquantized model, optionally with quantization='fp8')",
            tensor_name=name,
        )


NON_FINITE_CHUNK = 1 << 22  # elements per exact-count chunk (a 4 MiB mask at most)


def non_finite_count(tensor: torch.Tensor) -> int:
    """How many elements of a floating-point tensor are NaN or infinite (counted in chunks, so
    the mask stays small; one-byte chunks are upcast, as torch has no ``isfinite`` for
    float8_e4m3fn)."""
    count = 0
    for chunk in tensor.detach().reshape(-1).split(NON_FINITE_CHUNK):
        chunk = chunk.float() if chunk.element_size() == 1 else chunk
        count += int(chunk.numel() - torch.isfinite(chunk).sum())
    return count
