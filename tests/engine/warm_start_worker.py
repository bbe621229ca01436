"""A fresh process for the engine warm-start tests: build ``LLM``, answer greedy prompts, save.

Builds ``--model`` (llama-tiny by default; float32, random weights) at level 3 with the compile
cache at ``--cache-root``, answers ``PROMPTS`` greedily and writes JSON with each prompt's token
ids and logprobs and the compilation-counter deltas of the whole run (construction, warm-ups,
captures, steps).
Run (from the repository root):
python -m tests.engine.warm_start_worker --cache-root DIR --out F [--backend eager]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11, 12], [42]]


def run_engine(
    model: str, cache_root: str, backend: str, cudagraph_mode: str | None
) -> dict[str, Any]:
    """Build the engine, answer ``PROMPTS`` greedily, return tokens, logprobs and counters."""
    from pieceworks.core.counters import compilation_counter
    from pieceworks.engine.llm import LLM
    from pieceworks.sampling_params import SamplingParams

    compilation: dict[str, Any] = {"level": 3, "backend": backend, "cache_dir": cache_root}
    if cudagraph_mode is not None:
        compilation["cudagraph_mode"] = cudagraph_mode
    before = compilation_counter.clone()
    llm = LLM(model, dtype="float32", max_num_seqs=4, compilation_config=compilation)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    results = llm.generate(PROMPTS, greedy)
    llm.shutdown()
    outputs = [result.outputs[0] for result in results]
    return {
        "token_ids": [list(output.token_ids) for output in outputs],
        "logprobs": [
            [
                {str(token): entry.logprob for token, entry in step.items()}
                for step in output.logprobs
            ]
            for output in outputs
        ],
        "counters": {
            name: value - getattr(before, name) for name, value in vars(compilation_counter).items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--backend", default="eager")
    parser.add_argument("--cudagraph-mode", default=None)
    args = parser.parse_args()
    result = run_engine(args.model, args.cache_root, args.backend, args.cudagraph_mode)
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
