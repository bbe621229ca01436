"""Reading GGUF files (llama.cpp's format): a config.json dict, HF-named weights, tokenizer keys.

A GGUF file carries everything an HF directory does, under llama.cpp's names: the shape as
``<arch>.*`` metadata keys, the weights as (often quantized) tensors named ``blk.N.attn_q.weight``,
and the tokenizer (vocabulary, merges, special ids, chat template) as ``tokenizer.*`` keys. This
module translates the first two into what the HF path already consumes: ``gguf_hf_config`` builds
the config.json dict the model classes read, and ``gguf_weights_iterator`` yields ``(hf_name,
tensor)`` pairs one tensor at a time into ``loader.load_weights``, each dequantized (by
``gguf.quants``) right before it is yielded, so memory stays near one copy of the dequantized
weights. ``gguf_tokenizer_metadata`` hands the tokenizer keys to ``engine/tokenizer.py``.

llama.cpp's converter permutes the rows of the query and key projections (it pairs rotary halves
as adjacent rows, GPT-J style); ``unpermute_rows`` undoes that, so the HF-style rotary of the
models sees the rows in HF's order. Only the ``llama`` architecture is mapped; the reader is the
``gguf`` library's ``GGUFReader`` (memory-mapped; one per file and process, see ``open_gguf``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pieceworks.models.loading.weight_utils import WeightLoadingError

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor

GGUF_SUFFIX = ".gguf"
SUPPORTED_ARCHITECTURES = ("llama",)
_REQUIRED = object()

# GGUF tensor names of a transformer block -> the HF module names (llama.cpp's gguf-py
# tensor_mapping, read in the other direction).
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP_NAME = re.compile(r"^(\w+)\.(weight|bias)$")


class GGUFMetadataError(ValueError):
    """A GGUF file lacks a metadata key pieceworks needs, or describes a model it cannot build."""


def is_gguf_path(model: str | Path) -> bool:
    """Whether ``model`` names a GGUF file (by its suffix; it need not exist)."""
    return str(model).lower().endswith(GGUF_SUFFIX)


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


def metadata_value(reader: GGUFReader, key: str, default: Any = _REQUIRED) -> Any:
    """The value of metadata ``key`` (a number, string, bool or list); ``default`` if absent,
    a ``GGUFMetadataError`` naming the key and the file if absent and required."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise GGUFMetadataError(
                f"{reader.data.filename}: the GGUF metadata has no {key!r}, which pieceworks needs "
                "to build the model; the file is incomplete or was not written by llama.cpp's "
                "convert_hf_to_gguf.py (re-convert it, or load the HF directory instead)"
            )
        return default
    return field.contents()


def _float32_value(value: float) -> float:
    """A float stored as float32, as the shortest decimal that rounds to it (1e-05, not
    9.999999747378752e-06), which is what the original config.json said."""
    return float(str(np.float32(value)))


def _file_dtype(reader: GGUFReader) -> str:
    """The ``torch_dtype`` the config reports: the file's float type, bfloat16 when quantized."""
    from gguf import GGMLQuantizationType as Q

    types = {tensor.tensor_type for tensor in reader.tensors}
    if types <= {Q.F32}:
        return "float32"
    if types <= {Q.F32, Q.F16}:
        return "float16"
    return "bfloat16"


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
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
        return None if scale == 1.0 else {"rope_type": "linear", "factor": _float32_value(scale)}
    if scaling_type == "none":
        return None
    if scaling_type != "linear":
        raise GGUFMetadataError(
            f"{reader.data.filename}: {arch}.rope.scaling.type={scaling_type!r} is not supported "
            "from GGUF (supported: none, linear); load the model's HF directory instead"
        )
    factor = metadata_value(reader, f"{arch}.rope.scaling.factor")
    return {"rope_type": "linear", "factor": _float32_value(factor)}


# Metadata keys of features llama.cpp's llama may carry that pieceworks does not implement, and
# the value that switches each off (absent is off too).
_UNSUPPORTED_KEYS = {
    "expert_count": 0,  # mixture of experts
    "attention.sliding_window": 0,
    "attention.clamp_kqv": 0,
    "logit_scale": 1.0,
}


def _refuse_unsupported(reader: GGUFReader, arch: str, head_dim: int) -> None:
    """A metadata key that changes the computation in a way pieceworks does not implement."""
    filename = reader.data.filename
    for name, off in _UNSUPPORTED_KEYS.items():
        value = metadata_value(reader, f"{arch}.{name}", off)
        if value != off:
            raise GGUFMetadataError(
                f"{filename}: {arch}.{name}={value!r} is not supported (pieceworks' llama "
                f"needs it absent or {off!r}); load the model's HF directory instead"
            )
    value_length = metadata_value(reader, f"{arch}.attention.value_length", head_dim)
    rotary_dim = metadata_value(reader, f"{arch}.rope.dimension_count", head_dim)
    for key, value in (
        ("attention.value_length", value_length),
        ("rope.dimension_count", rotary_dim),
    ):
        if value != head_dim:
            raise GGUFMetadataError(
                f"{filename}: {arch}.{key}={value} is not supported: pieceworks' llama needs it "
                f"equal to the head dimension ({arch}.attention.key_length or embedding_length "
                f"/ head_count = {head_dim})"
            )


def gguf_hf_config(path: str | Path) -> dict[str, Any]:
    """The config.json dict (HF ``LlamaConfig`` keys) that the GGUF file's metadata describes."""
    reader = open_gguf(path)
    arch = metadata_value(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFMetadataError(
            f"{path}: general.architecture={arch!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}); load the model's HF directory instead"
        )

    def key(name: str, default: Any = _REQUIRED) -> Any:
        return metadata_value(reader, f"{arch}.{name}", default)

    hidden_size = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    num_kv_heads = key("attention.head_count_kv", num_heads)
    if not isinstance(num_kv_heads, int):
        raise GGUFMetadataError(
            f"{path}: {arch}.attention.head_count_kv={num_kv_heads!r}: per-layer KV head counts "
            "are not supported (one integer for every layer is)"
        )
    head_dim = int(key("attention.key_length", hidden_size // num_heads))
    _refuse_unsupported(reader, arch, head_dim)
    tensor_names = {tensor.name for tensor in reader.tensors}
    vocab_size = key("vocab_size", None)
    if vocab_size is None:
        vocab_size = len(metadata_value(reader, "tokenizer.ggml.tokens"))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(num_kv_heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": _float32_value(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_value(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(reader, arch),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "hidden_act": "silu",
        "bos_token_id": metadata_value(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": metadata_value(reader, "tokenizer.ggml.eos_token_id", None),
        "torch_dtype": _file_dtype(reader),
    }
    return config


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), None for a name llama.cpp's llama has not."""
    match = _BLOCK_NAME.match(gguf_name)
    if match:
        layer, module, leaf = match.groups()
        hf_module = _BLOCK_TENSORS.get(module)
        return None if hf_module is None else f"model.layers.{layer}.{hf_module}.{leaf}"
    match = _TOP_NAME.match(gguf_name)
    if match and match.group(1) in _TOP_TENSORS:
        return f"{_TOP_TENSORS[match.group(1)]}.{match.group(2)}"
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

    Query and key rows are put back in HF order (``unpermute=False`` keeps llama.cpp's order,
    which only a test that checks the permutation matters wants). A tensor with no HF name is a
    ``WeightLoadingError`` naming it.
    """
    reader = open_gguf(path)
    num_heads = hf_config["num_attention_heads"]
    num_kv_heads = hf_config.get("num_key_value_heads", num_heads)
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise WeightLoadingError(
                f"GGUF tensor {tensor.name!r} has no place in a llama model "
                "(is the file's general.architecture right?)",
                tensor_name=tensor.name,
            )
        weight = dequantize_tensor(tensor)
        if unpermute and ".self_attn.q_proj." in name:
            weight = unpermute_rows(weight, num_heads)
        elif unpermute and ".self_attn.k_proj." in name:
            weight = unpermute_rows(weight, num_kv_heads)
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
