"""Building a model and loading a checkpoint into it.

Which source a model string names (preset, HF directory, GGUF file) is ``sources.py``'s business,
and so is ``get_model``, which takes its weight stream from there, so GGUF weights
(``gguf_loader.py``) arrive here under HF names like any checkpoint's; reading HF directories is
``hf_directory.py``'s. Nothing here imports ``sources`` or ``presets``: both import this module.

Owns building a model on the ``meta`` device and materialising it (``initialize_model``), and
checking a load (``load_weights``): every checkpoint tensor must land in a parameter with the
right shape (the contract in ``weight_utils.py``), every parameter must be loaded, and no loaded
parameter may hold NaN or infinity, or a ``WeightLoadingError`` names the tensors. After loading,
each layer's quantization method rewrites its weights (``process_weights_after_loading``; FP8
quantizes them, per rank). This module never knows a model's names. It does not know hardware
either: the device comes from the caller.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from pieceworks.config import resolve_dtype
from pieceworks.kernels.chooser import KernelChooser
from pieceworks.models.loading.weight_utils import (
    WeightLoadingError,
    check_checkpoint_dtype,
    non_finite_count,
    preview_names,
)
from pieceworks.models.registry import get_model_class

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig


@contextlib.contextmanager
def set_default_torch_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside get ``dtype``."""
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old_dtype)


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, attribute) that hold one parameter (tied embeddings)."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, name))
    return [group for group in owners.values() if len(group) > 1]


def materialize_model(model: nn.Module, device: torch.device | str) -> nn.Module:
    """Allocate a ``meta``-device model on ``device`` (uninitialised), keeping ties and buffers.

    ``to_empty`` gives every parameter its own new tensor, which unties tied weights: the ties are
    restored afterwards. Modules with derived buffers (rotary cos/sin) rebuild them in
    ``init_buffers()``.
    """
    shared = _shared_parameters(model)
    model.to_empty(device=device)
    for (first_module, first_name), *others in shared:
        for module, name in others:
            setattr(module, name, getattr(first_module, first_name))
    for module in model.modules():
        init_buffers = getattr(module, "init_buffers", None)
        if callable(init_buffers):
            init_buffers()
    return model


def initialize_model(
    config: EngineConfig, device: torch.device | str, kernels: KernelChooser | None = None
) -> nn.Module:
    """Build the model class named by config.json on ``meta``, let every layer take its kernels
    from ``kernels`` (the engine's chooser; None: a new one for the current platform and the
    config's ``custom_ops``), then allocate it on ``device``."""
    model_config = config.model_config
    model_cls = get_model_class(model_config.hf_config)
    dtype = resolve_dtype(model_config.dtype, model_config.hf_config)
    with set_default_torch_dtype(dtype), torch.device("meta"):
        model = model_cls(config=config)
    choose_kernels(model, kernels or KernelChooser.for_current_platform(config.compilation_config))
    return materialize_model(model, device)


def choose_kernels(model: nn.Module, kernels: KernelChooser) -> None:
    """Every layer (and linear layer's ``quant_method``) takes its kernels from ``kernels``."""
    for module in model.modules():
        for owner in (module, getattr(module, "quant_method", None)):
            hook = getattr(owner, "choose_kernels", None)
            if callable(hook):
                hook(kernels)


def _unpack_param_name(param_name: str, packed: dict[str, list[str]]) -> list[str]:
    """``...qkv_proj.weight`` -> the checkpoint names it is stacked from (``q_proj``, ...)."""
    module_path, _, leaf = param_name.rpartition(".")
    parent, _, module_name = module_path.rpartition(".")
    if module_name not in packed:
        return [param_name]
    parent = f"{parent}." if parent else ""
    return [f"{parent}{sub_module}.{leaf}" for sub_module in packed[module_name]]


def expected_checkpoint_names(model: nn.Module) -> set[str]:
    """Every checkpoint tensor the model needs, from its parameters and ``packed_modules_mapping``.

    Tied parameters appear once (``named_parameters`` drops duplicates), so a tied LM head needs
    no ``lm_head.weight``.
    """
    packed = getattr(model, "packed_modules_mapping", {})
    names: set[str] = set()
    for param_name, _ in model.named_parameters():
        names.update(_unpack_param_name(param_name, packed))
    return names


def check_parameters_finite(model: nn.Module) -> None:
    """A ``WeightLoadingError`` naming the checkpoint tensors of any loaded parameter that holds
    NaN or infinity (one would poison every logit it reaches).

    Runs once after loading, where the parameters live (on an accelerator, at its bandwidth):
    one ``aminmax`` per parameter, which NaN and infinities propagate to, and one host sync for
    all of them; only a bad parameter is then counted exactly.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.numel() and p.is_floating_point()]
    flags = []
    for _, param in named:
        if param.element_size() == 1:  # float8 has no aminmax
            flags.append(torch.tensor(non_finite_count(param) > 0, device=param.device))
            continue
        low, high = torch.aminmax(param.detach())
        flags.append(~(torch.isfinite(low) & torch.isfinite(high)))
    if not flags:
        return
    bad = [name for (name, _), flag in zip(named, torch.stack(flags).tolist()) if flag]
    if not bad:
        return
    params = dict(named)
    sources = _unpack_param_name(bad[0], getattr(model, "packed_modules_mapping", {}))
    shown = ", ".join(map(repr, sources))
    into = "" if sources == [bad[0]] else f" (loaded into {bad[0]!r})"
    others = (
        f"; {len(bad) - 1} more parameter(s) too: {preview_names(bad[1:], 5)}" if bad[1:] else ""
    )
    raise WeightLoadingError(
        f"checkpoint tensor {shown}{into} holds {non_finite_count(params[bad[0]])} NaN or "
        f"infinite value(s) of {params[bad[0]].numel()}{others}; the checkpoint is damaged: "
        "re-download or re-save it",
        tensor_name=sources[0],
    )


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    """Feed ``weights`` to ``model.load_weights`` and check that nothing is missing.

    Returns the checkpoint names consumed. Raises ``WeightLoadingError`` naming the tensor for an
    unexpected, mis-shaped or non-float tensor, listing every missing one, and naming the
    tensors of a parameter that holds NaN or infinity.
    """
    seen: list[str] = []
    # A model whose checkpoints name its modules otherwise maps each name first (vLLM's
    # ``hf_to_vllm_mapper``), e.g. Nemotron-H's ``backbone.`` -> ``model.``.
    rename = getattr(model, "map_checkpoint_name", None)

    def tracked() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            name = rename(name) if rename is not None else name
            seen.append(name)
            check_checkpoint_dtype(name, tensor)
            yield name, tensor

    try:
        model.load_weights(tracked())  # type: ignore[operator]
    except WeightLoadingError as error:
        if error.tensor_name is not None or not seen:
            raise
        raise WeightLoadingError(f"checkpoint tensor {seen[-1]!r}: {error}", seen[-1]) from None
    missing = sorted(expected_checkpoint_names(model) - set(seen))
    if missing:
        raise WeightLoadingError(
            f"the checkpoint lacks {len(missing)} tensor(s) that {type(model).__name__} needs: "
            f"{preview_names(missing)}"
        )
    check_parameters_finite(model)
    return set(seen)


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer's ``quant_method`` rewrite its loaded weights (FP8: quantize them)."""
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(module)
