"""Loading HF-format model directories: config.json, safetensors, the weight-loading contract.

Which source a model string names (preset, HF directory, GGUF file) is ``sources.py``'s business,
and so is ``get_model``, which takes its weight stream from there, so GGUF weights
(``gguf_loader.py``) arrive here under HF names like any checkpoint's. Nothing here imports
``sources`` or ``presets``: both import this module.

Owns reading (``load_hf_config``, ``hf_weights_iterator`` over ``model.safetensors`` or a sharded
``model.safetensors.index.json``), writing (``save_hf_directory``), building a model on the
``meta`` device and materialising it (``initialize_model``), and checking a load
(``load_weights``): every checkpoint tensor must land in a parameter with the right shape and every
parameter must be loaded, or a ``WeightLoadingError`` names the tensors. With tensor parallelism
every rank reads the whole checkpoint and each sharded layer's ``weight_loader`` keeps its rank's
slice (``shard_rows``, which checks the unsharded shape first); replicated parameters (norms) are
copied whole. After loading, each layer's quantization method rewrites its weights
(``process_weights_after_loading``; FP8 quantizes them, per rank). Each model maps HF names to its
own parameters in its ``load_weights`` (vLLM style); this module never knows a model's names. It
does not know hardware either: the device comes from the caller.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pieceworks.config import resolve_dtype
from pieceworks.kernels.chooser import KernelChooser
from pieceworks.models.registry import get_model_class

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig

CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")  # weights saved with torch.save, which pieceworks refuses
# Buffers some HF checkpoints carry that pieceworks recomputes (vLLM skips the same names).
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# transformers 5 writes non-finite floats as {"__float__": "Infinity"} (standard JSON has none).
FLOAT_TAG_KEY = "__float__"
FLOAT_TAG_VALUES = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


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


def _preview(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... and {len(names) - limit} more"


# ---------------------------------------------------------------------------------------------
# Reading and writing HF directories


def _decode_special_float(obj: dict[str, Any]) -> Any:
    """``{"__float__": "Infinity"}`` (and ``-Infinity``, ``NaN``), as transformers 5 writes
    non-finite floats into config.json, back to the float; any other object unchanged."""
    if set(obj) == {FLOAT_TAG_KEY} and obj[FLOAT_TAG_KEY] in FLOAT_TAG_VALUES:
        return FLOAT_TAG_VALUES[obj[FLOAT_TAG_KEY]]
    return obj


def parse_hf_config(text: str) -> dict[str, Any]:
    """A config.json text as a dict, as any transformers version writes it: non-finite floats
    either bare (``Infinity``, older versions) or tagged (``{"__float__": "Infinity"}``, 5.x).
    Nested rope settings (``rope_parameters``) stay nested; ``get_rope_parameters`` reads both
    spellings."""
    config = json.loads(text, object_hook=_decode_special_float)
    if not isinstance(config, dict):
        raise ValueError(f"config.json must hold a JSON object, not {type(config).__name__}")
    return config


def load_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The ``config.json`` dict of an HF-format directory (see ``parse_hf_config``)."""
    path = Path(model_dir) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: pass a preset name, a *.gguf file or a directory in HF format "
            "(config.json + *.safetensors)"
        )
    try:
        return parse_hf_config(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); fix or re-download it") from None


def read_json_file(path: Path) -> Any:
    """A JSON file's content; a ``ValueError`` naming the file and the position if it does not
    parse."""
    try:
        return json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); fix or re-download it") from None


def hf_weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a directory: the index's shards, or ``model.safetensors``."""
    model_dir = Path(model_dir)
    index_path = model_dir / SAFE_WEIGHTS_INDEX_NAME
    if index_path.is_file():
        weight_map = read_json_file(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise WeightLoadingError(
                f"{index_path} has no 'weight_map' of tensor names to shard files; re-save "
                "the checkpoint"
            )
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [str(path) for path in files if not path.is_file()]
        if absent:
            raise FileNotFoundError(f"{index_path} lists shards that do not exist: {absent}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in model_dir.glob("*") if p.suffix in PICKLE_SUFFIXES)
        found = f" (found {', '.join(pickles)}: PyTorch pickles, not read)" if pickles else ""
        raise FileNotFoundError(
            f"{model_dir} has no *.safetensors weights{found}; pieceworks reads safetensors "
            "only: re-save the model with save_pretrained(..., safe_serialization=True)"
        )
    return files


def hf_weights_iterator(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every shard, on the CPU, one at a time."""
    from safetensors import safe_open

    for path in hf_weight_files(model_dir):
        try:
            shard = safe_open(str(path), framework="pt", device="cpu")
        except Exception as error:  # safetensors raises its own SafetensorError (and OSError)
            raise WeightLoadingError(
                f"{path} is not a readable safetensors file ({error}); it may be truncated or "
                "not a checkpoint: re-download or re-save it"
            ) from None
        with shard:
            for name in shard.keys():
                yield name, shard.get_tensor(name)


def _split_into_shards(
    tensors: dict[str, torch.Tensor], max_shard_bytes: int | None
) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        num_bytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes and shards[-1] and shard_bytes + num_bytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += num_bytes
    return shards


def save_hf_directory(
    state_dict: dict[str, torch.Tensor],
    hf_config: dict[str, Any],
    path: str | Path,
    *,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write ``config.json`` and the weights (HF names) as an HF-format directory.

    With ``max_shard_bytes`` the weights are split into ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json``, as ``save_pretrained`` does. Old weight files are removed.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for stale in [*path.glob("*.safetensors"), path / SAFE_WEIGHTS_INDEX_NAME]:
        stale.unlink(missing_ok=True)
    (path / CONFIG_NAME).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in state_dict.items()}
    shards = _split_into_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(path / SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        return path
    weight_map: dict[str, str] = {}
    for index, shard in enumerate(shards, start=1):
        filename = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    total_size = sum(t.numel() * t.element_size() for t in tensors.values())
    index_json = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (path / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index_json, indent=2) + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# Building and loading models


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
    the mask stays small; float8 chunks are upcast, having no ``isfinite`` of their own)."""
    count = 0
    for chunk in tensor.detach().reshape(-1).split(NON_FINITE_CHUNK):
        chunk = chunk.float() if chunk.element_size() == 1 else chunk
        count += int(chunk.numel() - torch.isfinite(chunk).sum())
    return count


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
    others = f"; {len(bad) - 1} more parameter(s) too: {_preview(bad[1:], 5)}" if bad[1:] else ""
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

    def tracked() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
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
            f"{_preview(missing)}"
        )
    check_parameters_finite(model)
    return set(seen)


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer's ``quant_method`` rewrite its loaded weights (FP8: quantize them)."""
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(module)
