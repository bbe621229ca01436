"""``bench throughput``: offline tokens per second over many prompts (vLLM's benchmark_throughput).

All prompts go to one ``LLM.generate`` call, so the scheduler batches them as it would a full
queue: continuous batching up to ``max_num_seqs`` with chunked prefill. Prompts are random token
ids (``input_len``, or lengths sampled within ``range_ratio``) and every request generates
``output_len`` tokens with ``ignore_eos``, greedy. A short warm-up call first runs the compile
and the first step outside the timing. Reports requests, output tokens and all tokens per second.
"""

from __future__ import annotations

import time
from typing import Any

from pieceworks.benchmarks.serve import sample_requests


def measure_throughput(
    model: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    compilation_config: Any = None,
    **engine_args: Any,
) -> dict[str, Any]:
    """Build the engine, warm it up, time one ``generate`` over ``num_prompts`` prompts."""
    from pieceworks.engine.llm import LLM
    from pieceworks.sampling_params import SamplingParams

    llm = LLM(model, compilation_config=compilation_config, **engine_args)
    vocab_size = int(llm.config.model_config.hf_config.get("vocab_size") or 256)
    requests = sample_requests(
        num_prompts, input_len, output_len, range_ratio, vocab_size=vocab_size, seed=seed
    )
    prompts = [request.prompt for request in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    num_output = sum(len(out.outputs[0].token_ids) for out in outputs)
    num_input = sum(r.prompt_len for r in requests)
    return {
        "model": model,
        "num_prompts": num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "range_ratio": range_ratio,
        "elapsed_s": elapsed,
        "total_input_tokens": num_input,
        "total_output_tokens": num_output,
        "requests_per_s": num_prompts / elapsed,
        "output_tokens_per_s": num_output / elapsed,
        "total_tokens_per_s": (num_input + num_output) / elapsed,
    }
