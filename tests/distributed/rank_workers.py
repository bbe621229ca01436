"""What each rank of the tensor-parallel tests runs: build engines, generate, report back.

Every rank builds its own in-process ``EngineCore`` with ``ParallelConfig(tensor_parallel_size,
rank)``; the scheduler is deterministic, so the ranks schedule the same steps and meet in the same
collectives without any broadcast. ``generate`` records the float32 logits of every step by
wrapping the model's ``compute_logits`` (which gathers the vocabulary on every rank).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pieceworks.benchmarks.modes import compilation_for_mode
from pieceworks.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pieceworks.core.counters import compilation_counter
from pieceworks.models.loading.hf_directory import load_hf_config
from pieceworks.sampling_params import SamplingParams

MAX_NUM_SEQS = 4
NUM_BLOCKS = 32  # fixed, so every rank's scheduler sees the same cache (no memory probing)
SAMPLING_SEED = 1234  # rank r seeds its default generator with SAMPLING_SEED + r


def engine_config(
    checkpoint: str, mode: str, tp_size: int = 1, rank: int = 0, **model_args: Any
) -> EngineConfig:
    """Float32, 4 sequences, ``mode`` compiled with the eager backend (as arg_utils builds it)."""
    return EngineConfig(
        model_config=ModelConfig(
            model=checkpoint,
            hf_config=load_hf_config(checkpoint),
            dtype="float32",
            max_model_len=128,
            **model_args,
        ),
        cache_config=CacheConfig(num_gpu_blocks_override=NUM_BLOCKS),
        scheduler_config=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=256),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size, rank=rank),
        compilation_config=compilation_for_mode(mode, {"backend": "eager"}),
    )


def cache_shapes(config: EngineConfig) -> dict[str, list[tuple[int, ...]]]:
    """Per layer: the key cache's and the Mamba conv and SSM states' shapes, as bound."""
    from pieceworks.worker.kv_cache import attention_layers
    from pieceworks.worker.mamba_cache import mamba_layers

    kv = [tuple(layer.bound_kv_cache()[0].shape) for layer in attention_layers(config)]
    states = [layer.mamba_cache for layer in mamba_layers(config)]
    return {
        "kv": kv,
        "conv": [tuple(conv.shape) for conv, _ in states],
        "ssm": [tuple(ssm.shape) for _, ssm in states],
    }


def generate(
    config: EngineConfig,
    prompts: list[list[int]],
    max_tokens: int,
    default_seed: int | None = None,
) -> tuple[list[list[int]], list[np.ndarray]]:
    """Tokens per prompt and the logits ``(S, vocab)`` of every step that sampled: greedy, or,
    with ``default_seed``, the default ``SamplingParams`` (temperature 1, unseeded) drawing from
    torch's default generator seeded with it once the engine is built."""
    import torch

    from pieceworks.engine.core import EngineCore

    engine = EngineCore(config)
    model = engine.runner.model
    compute_logits = model.compute_logits
    step_logits: list[np.ndarray] = []

    def recording(hidden_states):
        logits = compute_logits(hidden_states)
        step_logits.append(logits.detach().float().cpu().numpy().copy())
        return logits

    model.compute_logits = recording
    if default_seed is None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    else:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        torch.manual_seed(default_seed)
    requests = [engine.add_request(prompt, params) for prompt in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return [list(request.output_token_ids) for request in requests], step_logits


def generate_runs(
    rank: int,
    world_size: int,
    runs: dict[str, tuple[str, str, dict[str, Any]]],
    prompts: list[list[int]],
    max_tokens: int,
) -> dict[str, dict[str, Any]]:
    """``runs``: label -> (checkpoint, mode, extra ModelConfig fields). Per label: tokens, step
    logits and the number of pieces the split produced."""
    outputs = {}
    for label, (checkpoint, mode, model_args) in runs.items():
        config = engine_config(checkpoint, mode, world_size, rank, **model_args)
        before = compilation_counter.num_piecewise_graphs_seen
        tokens, logits = generate(config, prompts, max_tokens)
        pieces = compilation_counter.num_piecewise_graphs_seen - before
        outputs[label] = {
            "tokens": tokens,
            "logits": logits,
            "pieces": pieces,
            "caches": cache_shapes(config),
        }
    return outputs


def sample_on_ranks(
    rank: int, world_size: int, checkpoint: str, prompts: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    """Unseeded sampling, eager, with a default generator seeded differently on every rank
    (``SAMPLING_SEED + rank``): only rank 0's broadcast ids keep the ranks in step."""
    config = engine_config(checkpoint, "eager", world_size, rank)
    tokens, logits = generate(config, prompts, max_tokens, default_seed=SAMPLING_SEED + rank)
    return {"tokens": tokens, "logits": logits}


def fail_on_rank(rank: int, world_size: int, checkpoint: str, failing_rank: int) -> None:
    """Rank ``failing_rank`` raises at once; the others build an engine and block in it."""
    if rank == failing_rank:
        raise RuntimeError(f"rank {rank} set-up failed on purpose")
    generate(engine_config(checkpoint, "eager", world_size, rank), [[1, 2, 3]], 2)


def build_engine(rank: int, world_size: int, checkpoint: str) -> None:
    """Build (and discard) an engine: for configurations whose set-up must raise on every rank."""
    generate(engine_config(checkpoint, "eager", world_size, rank), [[1, 2, 3]], 1)


def group_collectives(rank: int, world_size: int) -> dict[str, Any]:
    """Every collective of the TP group once, eagerly; the values each rank saw."""
    import torch

    from pieceworks.distributed import (
        get_tp_group,
        tensor_model_parallel_all_gather,
        tensor_model_parallel_all_reduce,
    )

    group = get_tp_group()
    x = torch.full((2, 3), float(rank + 1))
    reduced = tensor_model_parallel_all_reduce(x)  # the custom op, out of place
    op_reduced = torch.ops.pieceworks.all_reduce(x)
    group.barrier()
    return {
        "rank_and_size": (group.rank_in_group, group.world_size),
        "input_untouched": bool((x == rank + 1).all()),
        "all_reduce": reduced.tolist(),
        "op": op_reduced.tolist(),
        "gather_last": tensor_model_parallel_all_gather(x[:, :1] * 0 + rank).tolist(),
        "gather_first": tensor_model_parallel_all_gather(x[:1] * 0 + rank, dim=0).tolist(),
        "object": group.broadcast_object({"from": rank} if rank == 0 else None),
    }
