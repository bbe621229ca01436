"""Host profile of decode steps: where the engine's Python spends a step, phase by phase.

Builds the engine, queues ``--batch-size`` random prompts, steps until the whole batch decodes,
then times ``--steps`` decode steps of ``LLM.generate``'s loop (``OutputProcessor.step``) with a
``perf_counter`` around each phase: schedule, plan (pad + graph dispatch), prepare inputs (the
buffers, the on-device placeholder fill and, with multi-step decode, the on-device advance to the
next step), forward (the call into the model or its graph),
logits, sample, wait (the step's one host sync, on the previous step's tokens), update (stop checks
and token bookkeeping), and "other", the rest of the step (forward-context setup, the staging copy,
output processing, the engine's own bookkeeping). ``host work`` is the step minus the wait: with
async scheduling the device sits idle whenever it exceeds the device's time per step.

On a GPU ``forward`` is the launch (a graph replay, or the pieces' launches in PIECEWISE) and the
device time shows up in ``wait``; on the CPU the forward runs inline. ``--num-layers`` rebuilds a
preset with fewer layers (random weights, a temporary HF directory), e.g. the SmolLM2 shape with 2
layers on the CPU. ``--stub-model`` replaces the forward and the LM head with stubs that return
zeros, so a step costs only the engine's own work (tokens are then meaningless). ``--cprofile N``
prints the N functions with the most own time instead. ``--num-scheduler-steps K`` runs K decode
steps per host round trip (multi-step decode); every figure is per decode step, i.e. per generated
token of each request, whatever K (``--steps`` counts decode steps too).

    python benchmarks/profile_host.py --model llama-tiny --batch-sizes 1,8,64
    python benchmarks/profile_host.py --model smollm2-135m-random --num-layers 2
    python benchmarks/profile_host.py --model llama-tiny --mode eager --stub-model --clock cpu
    python benchmarks/profile_host.py --model llama-tiny --stub-model --num-scheduler-steps 8
    python benchmarks/profile_host.py --model llama-125m --mode full_and_piecewise   # on a GPU
    python benchmarks/profile_host.py --model smollm2-135m-random --num-layers 2 \
        --tokenizer .assets/smollm2-tokenizer --json-schema   # every request constrained

``--json-schema`` constrains every request with a one-string-field JSON schema (the serving
benchmark's ``structured`` row; a grammar needs the tokenizer's vocabulary, hence
``--tokenizer`` for random weights); ``grammar`` is then the host's bitmask work (the previous
step's tokens accepted, the bitmask filled) and ``mask`` its application to the logits.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pieceworks.benchmarks.modes import compilation_for_mode  # noqa: E402
from pieceworks.engine.llm import LLM  # noqa: E402
from pieceworks.models.loading.presets import get_preset, is_preset, random_hf_checkpoint  # noqa: E402
from pieceworks.platforms import current_platform  # noqa: E402
from pieceworks.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402
from pieceworks.worker.sampled_tokens import SampledTokens  # noqa: E402

PHASES = (
    "schedule",
    "plan",
    "prepare inputs",
    "forward",
    "logits",
    "sample",
    "wait",
    "update",
    "grammar",
    "mask",
)
# The structured-output row's constraint (benchmarks/gpu_suite.sh, JSON_SCHEMA).
JSON_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
# "wall" is what a step costs; "cpu" (this thread's CPU time) leaves out time the thread was not
# running, steadier on a shared machine, but it does not count the wait on the device either.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


class PhaseClock:
    """Accumulates seconds per phase; ``wrap`` times every call of a function as one phase."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.enabled = False
        self.now = now

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return fn(*args, **kwargs)
            start = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += self.now() - start

        return timed


@contextmanager
def instrumented(llm: LLM, clock: PhaseClock) -> Iterator[None]:
    """Time the engine's phases through instance attributes (and ``SampledTokens.tolist``)."""
    engine, runner = llm.engine, llm.engine.runner
    patches = [
        (engine.scheduler, "schedule", "schedule"),
        (engine.scheduler, "update_from_output", "update"),
        (runner, "plan", "plan"),
        (runner.inputs, "prepare", "prepare inputs"),  # the placeholder fill included
        (runner.inputs, "advance_decode", "prepare inputs"),
        (runner, "forward_model", "forward"),
        (runner.model, "compute_logits", "logits"),
        (runner.sampler, "sample", "sample"),
        (engine.structured_output, "grammar_bitmask", "grammar"),
        (runner.grammar_mask, "apply", "mask"),
    ]
    # (object, name, its own attribute or None where the name comes from its class)
    originals = [(obj, name, vars(obj).get(name)) for obj, name, _ in patches]
    for obj, name, phase in patches:
        object.__setattr__(obj, name, clock.wrap(phase, getattr(obj, name)))
    tolist = SampledTokens.tolist
    SampledTokens.tolist = clock.wrap("wait", tolist)  # type: ignore[method-assign]
    try:
        yield
    finally:
        SampledTokens.tolist = tolist  # type: ignore[method-assign]
        for obj, name, original in originals:
            if original is None:
                object.__delattr__(obj, name)
            else:
                object.__setattr__(obj, name, original)


def stub_model(llm: LLM, masked: bool) -> None:
    """Forward and LM head that return zeros at once: a step then costs only the engine.
    ``masked``: the grammar masks the logits in place, so each step's are zeroed again."""
    runner, hf_config = llm.engine.runner, llm.config.model_config.hf_config
    hidden = torch.zeros(runner.max_num_tokens, hf_config["hidden_size"], device=runner.device)
    logits = torch.zeros(runner.max_num_tokens, hf_config["vocab_size"], device=runner.device)
    runner.forward_model = lambda input_ids, positions: hidden[: input_ids.shape[0]]

    def compute_logits(rows: torch.Tensor) -> torch.Tensor:
        step_logits = logits[: rows.shape[0]]
        return step_logits.zero_() if masked else step_logits

    object.__setattr__(runner.model, "compute_logits", compute_logits)


def model_source(model: str, num_layers: int | None, workdir: str) -> str:
    if num_layers is None:
        return model
    if not is_preset(model):
        raise SystemExit("--num-layers rebuilds a preset; pass a preset name as --model")
    hf_config = {**get_preset(model), "num_hidden_layers": num_layers}
    return str(random_hf_checkpoint(hf_config, Path(workdir) / f"{model}-{num_layers}l"))


def decode_until_uniform(llm: LLM, batch_size: int) -> None:
    """Step until a step decodes the whole batch (prefills done), then two more."""
    engine = llm.engine
    engine.step_seconds.clear()
    while not engine.step_seconds or engine.step_seconds[-1][:2] != (True, batch_size):
        if not engine.has_unfinished_requests():
            raise SystemExit(
                f"batch {batch_size} never decoded as one batch (the KV cache is too small for "
                "it); lower --batch-sizes or --input-len"
            )
        llm.processor.step(stream=False)
    for _ in range(2):
        llm.processor.step(stream=False)


def profile_batch(llm: LLM, args: argparse.Namespace, batch_size: int) -> dict[str, Any]:
    rng = random.Random(batch_size)
    vocab_size = llm.config.model_config.hf_config["vocab_size"]
    # Room for the warm-up steps, the timed ones and the runs in flight around them.
    max_tokens = args.steps + 16 + 3 * llm.config.scheduler_config.num_scheduler_steps
    constraint = StructuredOutputsParams(json=JSON_SCHEMA) if args.json_schema else None
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, structured_outputs=constraint
    )
    request_ids = []
    for _ in range(batch_size):
        prompt = [rng.randrange(vocab_size) for _ in range(args.input_len)]
        request_ids.append(llm.processor.add_request(prompt, params))
    decode_until_uniform(llm, batch_size)
    clock = PhaseClock(CLOCKS[args.clock])
    call_seconds = []
    profiler = cProfile.Profile() if args.cprofile else None
    gc.collect()
    decode_steps = llm.engine.step_seconds  # one entry per decode step, K per call multi-step
    decode_steps.clear()
    with instrumented(llm, clock):
        clock.enabled = profiler is None
        while len(decode_steps) < args.steps:
            if profiler is not None:
                profiler.enable()
            start = clock.now()
            llm.processor.step(stream=False)
            call_seconds.append(clock.now() - start)
            if profiler is not None:
                profiler.disable()
    num_decode_steps = len(decode_steps)
    uniform = all(u and n == batch_size for u, n, _ in decode_steps)
    while llm.processor.has_unfinished_requests():  # drain and forget the batch
        llm.processor.step(stream=False)
    for request_id in request_ids:
        llm.processor.get_output(request_id, forget=True)
    if profiler is not None:
        stats = pstats.Stats(profiler).sort_stats("tottime")
        stats.print_stats(*([args.cprofile_filter] if args.cprofile_filter else []), args.cprofile)
    return phase_row(batch_size, clock, call_seconds, num_decode_steps, uniform)


def phase_row(
    batch_size: int,
    clock: PhaseClock,
    call_seconds: list[float],
    num_decode_steps: int,
    uniform: bool,
) -> dict[str, Any]:
    """Per decode step: the mean step, its phases and host work; ``call_seconds`` times each
    ``OutputProcessor.step`` call (one decode step each, or K with multi-step decode)."""
    step_us = sum(call_seconds) / num_decode_steps * 1e6
    phases_us = {phase: clock.seconds.get(phase, 0.0) / num_decode_steps * 1e6 for phase in PHASES}
    phases_us["other"] = step_us - sum(phases_us.values())
    steps_per_call = num_decode_steps / len(call_seconds)
    return {
        "batch_size": batch_size,
        "steps": num_decode_steps,
        "calls": len(call_seconds),
        "all_uniform_decode": uniform,
        "step_us": step_us,
        "median_step_us": sorted(call_seconds)[len(call_seconds) // 2] / steps_per_call * 1e6,
        "host_work_us": step_us - phases_us["wait"],
        "phases_us": phases_us,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = [*PHASES, "other"]
    header = ["batch", "step", "host work", *columns]
    print(" | ".join(f"{name:>14}" for name in header))
    for row in rows:
        cells = [str(row["batch_size"]), f"{row['step_us']:.1f}", f"{row['host_work_us']:.1f}"]
        cells += [f"{row['phases_us'][name]:.1f}" for name in columns]
        print(" | ".join(f"{cell:>14}" for cell in cells))
    print(
        "(us per decode step = per generated token of each request, mean over the timed steps; "
        "host work = step - wait)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--mode", default=None, help="a run mode (default: the platform's best)")
    parser.add_argument("--backend", default=None, help="compile backend (inductor | eager)")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-async-scheduling", action="store_true")
    parser.add_argument("--num-scheduler-steps", type=int, default=1)
    parser.add_argument("--stub-model", action="store_true")
    parser.add_argument("--json-schema", action="store_true", help="constrain every request")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer for random weights")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    parser.add_argument(
        "--cprofile-filter", default=None, help="only functions whose path matches this regex"
    )
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    if current_platform().name == "cpu":
        # One thread: with the cores shared, an OpenMP pool spinning on tiny matmuls costs more
        # than the matmuls and buries the host path being measured.
        torch.set_num_threads(1)
    has_graphs = current_platform().supports_static_graphs()
    mode = args.mode or ("full_and_piecewise" if has_graphs else "compiled")
    base = {"backend": args.backend} if args.backend else None
    with tempfile.TemporaryDirectory() as workdir:
        llm = LLM(
            model_source(args.model, args.num_layers, workdir),
            compilation_config=compilation_for_mode(mode, base),
            max_num_seqs=max(batch_sizes),
            max_model_len=args.input_len + args.steps + 64,
            dtype=args.dtype,
            async_scheduling=not args.no_async_scheduling,
            num_scheduler_steps=args.num_scheduler_steps,
            **({"tokenizer": args.tokenizer} if args.tokenizer else {}),
        )
        if args.stub_model:
            stub_model(llm, masked=args.json_schema)
        rows = [profile_batch(llm, args, batch_size) for batch_size in batch_sizes]
        llm.engine.shutdown()
    layers = f", {args.num_layers} layers" if args.num_layers else ""
    layers += ", stub forward and LM head" if args.stub_model else ""
    layers += ", every request constrained by a JSON schema" if args.json_schema else ""
    platform = current_platform().name
    print(
        f"{args.model}{layers}, mode {mode}, platform {platform}, {args.clock} clock, "
        f"{args.num_scheduler_steps} decode step(s) per host round trip"
    )
    if not args.cprofile:
        print_table(rows)
    if args.out:
        meta = {
            "model": args.model,
            "num_layers": args.num_layers,
            "mode": mode,
            "num_scheduler_steps": args.num_scheduler_steps,
            "json_schema": args.json_schema,
        }
        Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
