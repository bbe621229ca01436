"""What a user would otherwise run: the table of peers behind `bench latency --compare`.

Three ways to run the model of a ``LatencyCase`` without pieceworks, on the same device, in the
same dtype, with the same weights (``random_hf_weights`` of the same seed for a preset, the
checkpoint for a directory) and the same prompts (``latency._prompts``), one file each under
``peers/``:

- ``hf_eager`` (``peers/hf_eager.py``): ``model.generate(...)`` greedy, eager, HF's default dynamic
  KV cache.
- ``static_compiled`` (``peers/static_compiled.py``): the decode loop a capable user writes on HF
  transformers with the "torch.compile with a static cache" recipe, its attention reading each KV
  head once and its q/k/v projections fused (``peers/hf_attention.py``).
- ``gpt_fast`` (``peers/gpt_fast.py``): an independent hand-written loop (its own Llama modules,
  its own static cache), the check that ``static_compiled`` is not a straw man.

Which apply is decided up front (``applicable_baselines``): the two static loops need an
attention-only Llama (HF has no static cache for Mamba layers), HF eager runs any model HF builds.
Each peer returns a result shaped like ``latency.measure_mode``'s (``peers/harness.py``).

Not here: the CLI flag, the table, the copy bandwidth (``latency.measure_copy_bandwidth``).
``transformers`` is optional (the ``test`` extra) and imported only when a baseline runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pieceworks.benchmarks.latency import LatencyCase
from pieceworks.benchmarks.peers.gpt_fast import measure_gpt_fast
from pieceworks.benchmarks.peers.hf_eager import measure_hf_eager
from pieceworks.benchmarks.peers.hf_model import static_cache_skip_reason
from pieceworks.benchmarks.peers.static_compiled import measure_static_cache_compiled
from pieceworks.engine.arg_utils import resolve_hf_config

BASELINE_MODES = ("static_compiled", "gpt_fast", "hf_eager")

BASELINES: dict[str, Callable[..., dict[str, Any]]] = {
    "static_compiled": measure_static_cache_compiled,
    "gpt_fast": measure_gpt_fast,
    "hf_eager": measure_hf_eager,
}

STATIC_CACHE_PEERS = ("static_compiled", "gpt_fast")


def applicable_baselines(case: LatencyCase) -> tuple[list[str], list[dict[str, str]]]:
    """The peers that can run ``case``'s model, and the others with the reason (for the report)."""
    reason = static_cache_skip_reason(case, resolve_hf_config(case.model))
    run, skipped = [], []
    for name in BASELINE_MODES:
        if name in STATIC_CACHE_PEERS and reason:
            skipped.append({"mode": name, "reason": reason})
        else:
            run.append(name)
    return run, skipped
