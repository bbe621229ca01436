"""HF-format model directories: ``config.json`` and safetensors weights, read and written.

Reading: ``load_hf_config`` (``parse_hf_config`` accepts any transformers version's non-finite
floats) and ``hf_weights_iterator`` over ``model.safetensors`` or the shards a
``model.safetensors.index.json`` lists, one tensor at a time on the CPU; PyTorch pickles are
refused with a message saying how to re-save. Writing: ``save_hf_directory`` (one file, or shards
and an index as ``save_pretrained`` writes them). Knows no model and no hardware; which source a
model string names is ``sources.py``'s business.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pieceworks.models.loading.text_config import text_model_config
from pieceworks.models.loading.weight_utils import WeightLoadingError

CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")  # weights saved with torch.save, which pieceworks refuses
# transformers 5 writes non-finite floats as {"__float__": "Infinity"} (standard JSON has none).
FLOAT_TAG_KEY = "__float__"
FLOAT_TAG_VALUES = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


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
        config = parse_hf_config(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}); fix or re-download it") from None
    return text_model_config(config)  # a vision-language config: its text model's fields


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
