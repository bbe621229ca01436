"""Reading a GGUF file's metadata: the parsed reader, typed key look-ups and shared config pieces.

``open_gguf`` parses a file once per process (the ``gguf`` library's memory-mapped
``GGUFReader``); ``metadata_value`` reads one key, naming the key and the file when a required one
is missing. The helpers below build the config.json entries every architecture shares (the file's
dtype, rope scaling); the per-architecture translation lives in ``gguf_architectures.py`` and the
weights in ``gguf_loader.py``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gguf import GGUFReader

REQUIRED: Any = object()


class GGUFMetadataError(ValueError):
    """A GGUF file lacks a metadata key pieceworks needs, or describes a model it cannot build."""


@functools.lru_cache(maxsize=4)
def _cached_reader(path: str, mtime_ns: int) -> GGUFReader:
    from gguf import GGUFReader

    return GGUFReader(path)


def open_gguf(path: str | Path) -> GGUFReader:
    """The memory-mapped reader of ``path``, parsed once per process (config, tokenizer and
    weights all read the same file; parsing the metadata costs seconds)."""
    resolved = Path(path).resolve()
    if not resolved.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        return _cached_reader(str(resolved), resolved.stat().st_mtime_ns)
    except (ValueError, OSError, IndexError) as error:  # gguf's parse errors are ValueErrors
        raise GGUFMetadataError(
            f"{path} is not a readable GGUF file ({error}); it may be truncated or not a GGUF "
            "model: re-download or re-convert it"
        ) from None


def metadata_value(reader: GGUFReader, key: str, default: Any = REQUIRED) -> Any:
    """The value of metadata ``key`` (a number, string, bool or list); ``default`` if absent,
    a ``GGUFMetadataError`` naming the key and the file if absent and required."""
    field = reader.fields.get(key)
    if field is None:
        if default is REQUIRED:
            raise GGUFMetadataError(
                f"{reader.data.filename}: the GGUF metadata has no {key!r}, which pieceworks needs "
                "to build the model; the file is incomplete or was not written by llama.cpp's "
                "convert_hf_to_gguf.py (re-convert it, or load the HF directory instead)"
            )
        return default
    return field.contents()


def float32_value(value: float) -> float:
    """A float stored as float32, as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06), which is what the original config.json said."""
    return float(str(np.float32(value)))


def file_dtype(reader: GGUFReader) -> str:
    """The ``torch_dtype`` the config reports: the file's float type, bfloat16 when quantized."""
    from gguf import GGMLQuantizationType as Q

    types = {tensor.tensor_type for tensor in reader.tensors}
    if types <= {Q.F32}:
        return "float32"
    if types <= {Q.F32, Q.F16}:
        return "float16"
    return "bfloat16"


def rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    """HF's ``rope_scaling`` from ``<arch>.rope.scaling.*`` (none or linear; others refused)."""
    tensor_names = {tensor.name for tensor in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise GGUFMetadataError(
            f"{reader.data.filename}: the file carries per-frequency rope factors "
            "(rope_freqs.weight, llama3 rope scaling), which pieceworks does not read from GGUF; "
            "load the model's HF directory instead"
        )
    scaling_type = metadata_value(reader, f"{arch}.rope.scaling.type", None)
    if scaling_type is None:  # older files: only the linear factor, 1.0 meaning none
        scale = metadata_value(reader, f"{arch}.rope.scale_linear", 1.0)
        return None if scale == 1.0 else {"rope_type": "linear", "factor": float32_value(scale)}
    if scaling_type == "none":
        return None
    if scaling_type != "linear":
        raise GGUFMetadataError(
            f"{reader.data.filename}: {arch}.rope.scaling.type={scaling_type!r} is not supported "
            "from GGUF (supported: none, linear); load the model's HF directory instead"
        )
    factor = metadata_value(reader, f"{arch}.rope.scaling.factor")
    return {"rope_type": "linear", "factor": float32_value(factor)}
