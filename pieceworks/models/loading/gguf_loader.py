"""Reading GGUF files (llama.cpp's format): a config.json dict, HF-named weights, tokenizer keys.

A GGUF file carries everything an HF directory does, under llama.cpp's names: the shape as
``<arch>.*`` metadata keys, the weights as (often quantized) tensors named ``blk.N.attn_q.weight``,
and the tokenizer (vocabulary, merges, special ids, chat template) as ``tokenizer.*`` keys. This
module translates the first two into what the HF path already consumes: ``gguf_hf_config`` builds
the config.json dict the model classes read, and ``gguf_weights_iterator`` yields ``(hf_name,
tensor)`` pairs one tensor at a time into ``loader.load_weights``, each dequantized (by
``gguf.quants``) right before it is yielded, so memory stays near one copy of the dequantized
weights. ``gguf_tokenizer_metadata`` hands the tokenizer keys to ``engine/tokenizer.py``.

What differs per architecture (key and tensor names, llama's query/key row permutation, Gemma's
norm weights stored with 1 added) is declared in ``gguf_architectures.py``; this module applies
it. The architectures mapped are ``llama`` and ``gemma3``; the reader is the ``gguf`` library's
``GGUFReader`` (memory-mapped; one per file and process, see ``gguf_metadata.open_gguf``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pieceworks.models.loading.gguf_architectures import (
    ARCHITECTURES,
    TOP_TENSORS,
    GGUFArchitecture,
)
from pieceworks.models.loading.gguf_metadata import (
    GGUFMetadataError,
    metadata_value,
    open_gguf,
)
from pieceworks.models.loading.weight_utils import WeightLoadingError

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor

__all__ = [
    "GGUFMetadataError",
    "dequantize_tensor",
    "gguf_architecture",
    "gguf_hf_config",
    "gguf_tokenizer_metadata",
    "gguf_weights_iterator",
    "hf_tensor_name",
    "is_gguf_path",
    "metadata_value",
    "open_gguf",
    "unpermute_rows",
]

GGUF_SUFFIX = ".gguf"
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP_NAME = re.compile(r"^(\w+)\.(weight|bias)$")


def is_gguf_path(model: str | Path) -> bool:
    """Whether ``model`` names a GGUF file (by its suffix; it need not exist)."""
    return str(model).lower().endswith(GGUF_SUFFIX)


def gguf_architecture(reader: GGUFReader) -> GGUFArchitecture:
    """The conventions of the file's ``general.architecture``; an error naming it if unmapped."""
    arch = metadata_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFMetadataError(
            f"{reader.data.filename}: general.architecture={arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}); load the model's HF directory instead"
        )
    return ARCHITECTURES[arch]


def gguf_hf_config(path: str | Path) -> dict[str, Any]:
    """The config.json dict (HF keys of the file's architecture) its metadata describes."""
    reader = open_gguf(path)
    return gguf_architecture(reader).hf_config(reader)


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """The HF checkpoint name of a GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), None for a name ``arch`` has not."""
    match = _BLOCK_NAME.match(gguf_name)
    if match:
        layer, module, leaf = match.groups()
        hf_module = ARCHITECTURES[arch].block_tensors.get(module)
        return None if hf_module is None else f"model.layers.{layer}.{hf_module}.{leaf}"
    match = _TOP_NAME.match(gguf_name)
    if match and match.group(1) in TOP_TENSORS:
        return f"{TOP_TENSORS[match.group(1)]}.{match.group(2)}"
    return None


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's query/key row permutation for ``num_heads`` heads.

    llama.cpp's ``convert_hf_to_gguf.py`` writes ``w.reshape(H, 2, D // 2, ...).swapaxes(1, 2)``
    (each head's two rotary halves interleaved row by row); this is the inverse, for a weight of
    shape (H * D, in_features) or a bias of shape (H * D,).
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise WeightLoadingError(
            f"cannot undo the query/key permutation: {rows} rows for {num_heads} heads"
        )
    rest = tuple(weight.shape[1:])
    halves = weight.reshape(num_heads, head_dim // 2, 2, *rest)  # (H, D/2, 2, ...)
    return halves.transpose(1, 2).reshape(rows, *rest)


def dequantize_tensor(tensor: ReaderTensor) -> torch.Tensor:
    """One GGUF tensor as a float32 CPU tensor in torch (row-major, HF) order.

    Any type ``gguf.quants`` decodes works (F32, F16, BF16, Q4_0, Q4_1, Q5_*, Q8_0, the K- and
    IQ-quants); another is a ``WeightLoadingError`` naming the type and the tensor.
    """
    from gguf import quants

    try:
        array = quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise WeightLoadingError(
            f"GGUF tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which pieceworks "
            "cannot dequantize (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the "
            "K-quants Q2_K..Q6_K and the IQ quants); re-quantize the model to one of those",
            tensor_name=tensor.name,
        ) from None
    shape = tuple(int(dim) for dim in reversed(tensor.shape))  # GGUF lists the fastest dim first
    array = np.asarray(array, dtype=np.float32).reshape(shape)
    if not array.flags.writeable:  # F32 tensors come straight from the read-only memory map
        array = array.copy()
    return torch.from_numpy(array)


def gguf_weights_iterator(
    path: str | Path, hf_config: dict[str, Any], *, unpermute: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every tensor of the file, one at a time.

    Undone here, as the architecture declares: llama's query/key row permutation (put back in HF
    order; ``unpermute=False`` keeps llama.cpp's order, which only a test that checks the
    permutation wants) and Gemma's 1 added to every norm weight (subtracted, as transformers'
    GGUF loader does). A tensor with no HF name is a ``WeightLoadingError`` naming it.
    """
    reader = open_gguf(path)
    architecture = gguf_architecture(reader)
    num_heads = hf_config["num_attention_heads"]
    num_kv_heads = hf_config.get("num_key_value_heads", num_heads)
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, architecture.name)
        if name is None:
            raise WeightLoadingError(
                f"GGUF tensor {tensor.name!r} has no place in a {architecture.name} model "
                "(is the file's general.architecture right?)",
                tensor_name=tensor.name,
            )
        weight = dequantize_tensor(tensor)
        if unpermute and architecture.permuted_qk and ".self_attn.q_proj." in name:
            weight = unpermute_rows(weight, num_heads)
        elif unpermute and architecture.permuted_qk and ".self_attn.k_proj." in name:
            weight = unpermute_rows(weight, num_kv_heads)
        if architecture.norm_offset and tensor.name.endswith("norm.weight"):
            weight -= architecture.norm_offset
        yield name, weight


def gguf_tokenizer_metadata(path: str | Path) -> dict[str, Any]:
    """The file's ``tokenizer.*`` metadata keys (prefix dropped: ``ggml.tokens``,
    ``chat_template``, ...) as Python values; empty when the file has no tokenizer."""
    reader = open_gguf(path)
    prefix = "tokenizer."
    return {
        key[len(prefix) :]: metadata_value(reader, key)
        for key in reader.fields
        if key.startswith(prefix)
    }
