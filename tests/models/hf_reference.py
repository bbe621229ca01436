"""HF transformers reference models for equivalence tests: float32, eager attention, on the CPU.

Given an HF-format directory (e.g. one written by ``presets.random_hf_checkpoint``), build the HF
implementation of the same architecture with the same weights, and run one sequence through it.
The logit-equivalence tests (pieceworks vs HF, prefill / decode / mixed) use these. Needs
``transformers`` (the ``test`` extra); callers skip without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def _dtype_kwarg() -> dict[str, Any]:
    """transformers 5 names the argument ``dtype``; 4.x called it ``torch_dtype``."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return {"dtype": torch.float32} if major >= 5 else {"torch_dtype": torch.float32}


def build_hf_llama(model_dir: str | Path) -> Any:
    """HF ``LlamaForCausalLM`` from ``model_dir`` in float32 with eager attention, in eval mode."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        str(model_dir), attn_implementation="eager", **_dtype_kwarg()
    )
    return model.to(torch.float32).eval()


@torch.no_grad()
def hf_logits(
    model: Any, input_ids: list[int] | torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """float32 logits ``(T, vocab)`` of one sequence (a full prefill, no KV cache)."""
    input_ids = torch.as_tensor(input_ids, dtype=torch.long)[None]  # (1, T)
    position_ids = None if positions is None else torch.as_tensor(positions)[None]
    output = model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    return output.logits[0].float()


def hf_greedy(hf_model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """HF ``generate``'s greedy continuation of ``prompt``: ``max_tokens`` new token ids."""
    with torch.no_grad():
        output = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, min_new_tokens=0
        )
    return output[0, len(prompt) :].tolist()


def greedy_tokens(
    path: str, mode: str, prompts: list[list[int]], max_tokens: int, **engine_args: Any
) -> list[list[int]]:
    """pieceworks' greedy tokens of ``prompts`` (float32, EOS ignored) in graph ``mode``
    (``benchmarks.modes``), the eager compile backend."""
    from pieceworks.benchmarks.modes import compilation_for_mode
    from pieceworks.engine.llm import LLM
    from pieceworks.sampling_params import SamplingParams

    llm = LLM(
        path,
        compilation_config=compilation_for_mode(mode, {"backend": "eager"}),
        dtype="float32",
        **engine_args,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]
