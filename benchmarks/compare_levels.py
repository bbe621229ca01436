"""Logits of the same model at level 0 (eager) and level 3 with graphs, on one device.

Builds the model once per mode from the same preset or directory (same seed), runs one prefill
step of a few prompts through each engine's runner, and prints the largest logit difference
relative to the logit scale against the first mode, plus whether greedy tokens agree. A mode may
name a dtype (``eager@float32``): a float32 eager reference shows how much of a bf16 difference is
bf16 rounding that every mode has.

    python benchmarks/compare_levels.py --model llama-3.1-8b \
        --modes eager@float32,eager,compiled,full_and_piecewise --out check.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pieceworks.benchmarks.modes import compilation_for_mode  # noqa: E402
from pieceworks.engine.llm import LLM  # noqa: E402
from pieceworks.platforms import current_platform  # noqa: E402
from pieceworks.sampling_params import SamplingParams  # noqa: E402


def prefill_logits_and_tokens(
    model: str, mode: str, prompts: list[list[int]], max_tokens: int
) -> tuple[torch.Tensor, list[list[int]]]:
    mode, _, dtype = mode.partition("@")
    llm = LLM(
        model, compilation_config=compilation_for_mode(mode), max_num_seqs=8, dtype=dtype or "auto"
    )
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    output = engine.scheduler.schedule()
    logits = engine.runner.compute_logits(output).float().cpu()
    engine.scheduler.update_from_output(output, logits.argmax(-1).tolist())
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy)]
    llm.shutdown()
    del llm, engine
    gc.collect()
    current_platform().empty_cache()
    return logits, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--modes", default="eager@float32,eager,compiled,full_and_piecewise")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=generator).tolist() for n in (7, 33, 120)]
    reference_mode, *other_modes = args.modes.split(",")
    reference, reference_tokens = prefill_logits_and_tokens(
        args.model, reference_mode, prompts, args.max_tokens
    )
    report = {"model": args.model, "reference": reference_mode, "modes": {}}
    for mode in other_modes:
        logits, tokens = prefill_logits_and_tokens(args.model, mode, prompts, args.max_tokens)
        relative = float((logits - reference).abs().max() / reference.abs().max())
        same_tokens = [a == b for a, b in zip(tokens, reference_tokens)]
        report["modes"][mode] = {
            "max_abs_diff_over_scale": relative,
            "argmax_equal": bool((logits.argmax(-1) == reference.argmax(-1)).all()),
            "greedy_tokens_equal_per_prompt": same_tokens,
        }
        print(
            f"{mode} vs {reference_mode}: max |diff| / max |logit| = {relative:.2e}; "
            f"greedy {args.max_tokens} tokens equal per prompt: {same_tokens}",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
