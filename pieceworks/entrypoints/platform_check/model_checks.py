"""Conformance checks on the model zoo: each tiny preset (random weights) generates the same
greedy tokens in every graph mode the platform declares as eager does.

The checkpoints untie the embeddings and widen the initialisation so that greedy tokens change
from step to step (a stale replay would repeat them). Modes: ``piecewise`` and
``full_and_piecewise`` where the platform declares static graphs, ``breakable`` where it declares
breakable capture (``benchmarks/modes.py`` names them).
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from pieceworks.entrypoints.platform_check.report import CheckFailed, CheckOptions, CheckSkipped

MAX_NUM_SEQS = 4
NUM_TOKENS = 6
PROMPT_LENGTHS = (3, 9, 17, 5, 2)  # five prompts, four slots: prefills, mixed batches, decodes
_CONFIG_OVERRIDES = {
    "llama-tiny": {"tie_word_embeddings": False, "initializer_range": 0.2},
    "bamba-tiny": {},
}


def graph_modes(platform: Any) -> list[str]:
    """The run modes with graphs that the platform's capabilities declare."""
    capabilities = platform.capabilities()
    if not capabilities.static_graphs:
        return []
    modes = ["piecewise", "full_and_piecewise"]
    return modes + (["breakable"] if capabilities.breakable_capture else [])


class ZooRuns:
    """Checkpoints and eager tokens per model, made once for all of a model's modes."""

    def __init__(self, options: CheckOptions) -> None:
        self.options = options
        self.directory = tempfile.TemporaryDirectory(prefix="pieceworks-check-")
        self.paths: dict[str, str] = {}
        self.eager: dict[str, list[list[int]]] = {}

    def path(self, model: str) -> str:
        if model not in self.paths:
            from pieceworks.models.loading.presets import get_preset, random_hf_checkpoint

            config = {**get_preset(model), **_CONFIG_OVERRIDES.get(model, {})}
            path = f"{self.directory.name}/{model}"
            random_hf_checkpoint(config, path, seed=3, dtype=torch.float32)
            self.paths[model] = path
        return self.paths[model]

    def tokens(self, model: str, mode: str) -> list[list[int]]:
        from pieceworks.benchmarks.modes import compilation_for_mode
        from pieceworks.engine.llm import LLM
        from pieceworks.sampling_params import SamplingParams

        base = {"backend": self.options.backend} if self.options.backend else {}
        llm = LLM(
            self.path(model),
            compilation_config=compilation_for_mode(mode, base),
            dtype="float32",
            max_num_seqs=MAX_NUM_SEQS,
            num_gpu_blocks_override=64,
        )
        try:
            greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
            outputs = llm.generate(_prompts(), greedy)
            return [list(output.outputs[0].token_ids) for output in outputs]
        finally:
            llm.shutdown()

    def eager_tokens(self, model: str) -> list[list[int]]:
        if model not in self.eager:
            self.eager[model] = self.tokens(model, "eager")
        return self.eager[model]


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def model_check(runs: ZooRuns, model: str, mode: str | None):
    """The check for ``model`` in ``mode`` (None: the platform declares no graph mode)."""

    def check(platform: Any, options: CheckOptions) -> str:
        if mode is None:
            raise CheckSkipped("static graphs not declared: no graph mode to compare")
        expected = runs.eager_tokens(model)
        actual = runs.tokens(model, mode)
        for index, (want, got) in enumerate(zip(expected, actual, strict=True)):
            if want != got:
                raise CheckFailed(f"prompt {index}: eager gave {want}, {mode} gave {got}")
        return f"{len(expected)} prompts x {NUM_TOKENS} greedy tokens equal eager"

    return check
