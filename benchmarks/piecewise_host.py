"""Host time of a PIECEWISE step on the CPU, split by where it goes (simgraph platform).

A PIECEWISE step (every step that holds a prefill, with FULL_AND_PIECEWISE) replays one static
graph per piece and runs the splitting op (attention) eagerly between them, so a model of L layers
pays L + 1 wrapper calls and L attention calls of host time per step. On a GPU that time is the
device's idle time when the model is small. This script builds a model of the SmolLM2-135M shape's
depth (30 layers, ``--layers``) at a tiny width, so that the CPU's own work is small, with
PIECEWISE graphs only (every step, decode included, replays the pieces) on the simgraph platform,
and times each step split into (``--mode full`` replays FULL graphs instead, the general one for
mixed steps: what the same steps cost the host routed to FULL graphs):

- ``runner``: the engine's and runner's per-step work (scheduling, inputs, logits, sampling,
  update), i.e. the step minus the model's forward;
- ``replay``: the graph wrappers' own host path per piece (dispatch on the forward context, the
  entry lookup, the replay call), without the simulated device work inside;
- ``split op``: the attention op's host path (the direct call, the op's Python wrapper, the
  layer's plan lookup, the backend's run and its launch wrappers), without the kernels' work;
- ``stitch``: the stitched module's own code between those calls;
- ``dispatch``: the forward's way into the stitched module (a traced start: Dynamo's transformed
  bytecode, which gathers every parameter of the model as a graph input; a warm start: the
  stored ``GraphCall``, with the parameters bound once);
- ``sim device``: the simulated device work (with ``--replay simulate`` the pieces re-run by
  simgraph's replay, with ``--attention torch`` the reference attention): on a GPU this is
  device time, not host time. By default (``--replay skip``) a replay returns the captured
  outputs at once, as a device graph's launch does, and the step is host time only.

``--attention triton-stub`` (the default) runs the Triton attention backend, the GPU's, with
kernels whose launch does nothing (bound once, then launched through ``BoundKernel`` as on a
GPU), so ``split op`` is pieceworks' Python path up to Triton's launcher (not the launcher's C
call: that needs a device); ``--attention torch`` runs the CPU's reference backend. Tokens are
meaningless with the stubs: only the timing counts.

Rows: decode batches of ``--batch-sizes`` (PIECEWISE graphs) and, with ``--mixed``, a steady
stream where every step holds one new prompt of ``--prompt-len`` tokens beside the decodes. Each
figure is the mean per step (us) of ``--steps`` steps, the least disturbed of ``--repeats`` runs;
``host`` is the step without the simulated device work; ``per layer`` the forward's host time
(replay + split op + stitch + dispatch) over the layer count. Times are this thread's CPU time
(steadier than wall time on a shared machine): they show where the host's work goes and how a
change moves it, not what a GPU machine's faster host takes. A model's first start traces it;
later starts with the same configuration load the stored graph (``dispatch`` differs), and
``PIECEWORKS_DISABLE_COMPILE_CACHE=1`` makes every start trace.

    PIECEWORKS_PLATFORM=simgraph python benchmarks/piecewise_host.py
    PIECEWORKS_PLATFORM=simgraph python benchmarks/piecewise_host.py --mixed --cprofile 30
"""

from __future__ import annotations

import argparse
import contextlib
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
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pieceworks.benchmarks.modes import compilation_for_mode  # noqa: E402
from pieceworks.core.decorators import piecewise_backends  # noqa: E402
from pieceworks.core.splitting_call import SplittingCall  # noqa: E402
from pieceworks.core.static_graph import StaticGraphWrapperBase  # noqa: E402
from pieceworks.engine.llm import LLM  # noqa: E402
from pieceworks.kernels.attention import kv_cache, triton_attention  # noqa: E402
from pieceworks.models.attention.backends import (  # noqa: E402
    TorchAttentionBackend,
    TritonAttentionBackend,
)
from pieceworks.models.attention.layer import Attention  # noqa: E402
from pieceworks.models.loading.presets import get_preset, random_hf_checkpoint  # noqa: E402
from pieceworks.platforms import current_platform  # noqa: E402
from pieceworks.sampling_params import SamplingParams  # noqa: E402

# This thread's CPU time: steadier than the wall clock on a shared machine, and the host path is
# CPU work (the CPU platform's "device" work is CPU work too, and separated out).
NOW = time.thread_time
PARTS = ("runner", "replay", "split op", "stitch", "dispatch", "sim device")
# The SmolLM2-135M shape's depth and head layout at a width where the CPU computes little.
TINY_WIDTH = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
)


class StubCompiled:
    """What Triton's launch returns, with a launcher that does nothing."""

    function = packed_metadata = 0

    @staticmethod
    def run(*args: Any) -> None:
        return None


class StubKernel:
    """Stands in for a ``@triton.jit`` function: ``kernel[grid](...)`` launches nothing and
    returns a ``StubCompiled``, so ``KernelLaunch`` binds it and later calls take the bound
    path, as on a GPU (``kernels/bound_launch.py``)."""

    def __init__(self, kernel: Any) -> None:
        self.arg_names, self.signature = kernel.arg_names, kernel.signature

    def __getitem__(self, grid: Any) -> Callable[..., StubCompiled]:
        return lambda *args, **kwargs: StubCompiled()


class StubDriver:
    """Triton's active driver as the bound launch asks it: the current stream's handle."""

    @staticmethod
    def get_current_stream(device_index: int | None = None) -> int:
        return 0


def stub_triton_kernels() -> None:
    from triton.runtime import driver

    driver.set_active(StubDriver())  # type: ignore[arg-type]
    for module, names in (
        (triton_attention, ["_decode_split_kv_kernel", "_decode_reduce_kernel", "_prefill_kernel"]),
        (kv_cache, ["_store_kv_cache_kernel"]),
    ):
        for name in names:
            setattr(module, name, StubKernel(getattr(module, name)))


class Clock:
    """Seconds per part; ``timed`` wraps a function so that its calls count in a part, and
    ``device`` marks work inside an outer part that a GPU would do on the device."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.enabled = False

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        seconds = self.seconds

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled:
                return fn(*args, **kwargs)
            start = NOW()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[part] += NOW() - start

        return wrapper


@contextlib.contextmanager
def instrumented(llm: LLM, clock: Clock, attention: str) -> Iterator[None]:
    """Time the forward, the piece wrappers, the splitting calls and the simulated device work
    (class attributes, restored after; the runner's forward as an instance attribute)."""
    runner = llm.engine.runner
    wrapper_cls = current_platform().static_graph_wrapper_cls()
    (backend,) = piecewise_backends(runner.model)
    patches: list[tuple[Any, str, str]] = [
        (type(backend.split_gm), "forward", "stitched"),
        (StaticGraphWrapperBase, "__call__", "wrapper"),
        (wrapper_cls, "replay", "sim device"),
        (SplittingCall, "__call__", "split call"),
    ]
    if attention == "torch":
        patches += [
            (TorchAttentionBackend, "store_kv", "attention kernels"),
            (TorchAttentionBackend, "forward", "attention kernels"),
        ]
    # (owner, name, its own attribute, or None where the name comes from a base class)
    originals = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in patches]
    for owner, name, part in patches:
        function = owner.__dict__.get(name, getattr(owner, name))
        if isinstance(function, staticmethod):
            setattr(owner, name, staticmethod(clock.timed(part, function.__func__)))
        else:
            setattr(owner, name, clock.timed(part, function))
    forward_model = runner.forward_model  # an instance attribute (the compiled model's call)
    runner.forward_model = clock.timed("forward", forward_model)
    try:
        yield
    finally:
        runner.forward_model = forward_model
        for owner, name, original in originals:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def skip_replayed_work() -> None:
    """Make simgraph's replay return the captured outputs without re-running the piece: a device
    graph's replay is one launch, and the re-run's CPU time only adds noise to the host's."""
    wrapper_cls = current_platform().static_graph_wrapper_cls()
    wrapper_cls.replay = lambda self, entry, args, kwargs: entry.output  # type: ignore[method-assign]


def use_attention(llm: LLM, attention: str) -> int:
    """Point every attention layer at the chosen backend; the number of layers."""
    layers = [
        layer
        for layer in llm.config.compilation_config.static_forward_context.values()
        if isinstance(layer, Attention)
    ]
    if attention == "triton-stub":
        stub_triton_kernels()
        for layer in layers:
            layer.backend = TritonAttentionBackend
            layer.bind_kv_cache(layer.kv_cache)  # forget the torch backend's plans
    return len(layers)


def parts_per_step(clock: Clock, step_seconds: float, num_steps: int) -> dict[str, float]:
    """The step's parts in us per step (module docstring)."""
    names = ("forward", "stitched", "wrapper", "sim device", "split call", "attention kernels")
    s = {part: clock.seconds.get(part, 0.0) for part in names}
    parts = {
        "runner": step_seconds - s["forward"],
        "replay": s["wrapper"] - s["sim device"],
        "split op": s["split call"] - s["attention kernels"],
        "sim device": s["sim device"] + s["attention kernels"],
    }
    parts["stitch"] = s["stitched"] - s["wrapper"] - s["split call"]
    parts["dispatch"] = s["forward"] - s["stitched"]
    return {part: seconds / num_steps * 1e6 for part, seconds in parts.items()}


class Workload:
    """Requests for one row: a decode batch, or a stream with one new prompt every step."""

    def __init__(self, llm: LLM, batch_size: int, mixed: bool, args: argparse.Namespace) -> None:
        self.llm, self.batch_size, self.mixed = llm, batch_size, mixed
        self.prompt_len = args.prompt_len
        self.rng = random.Random(batch_size)
        # A mixed stream keeps batch_size requests running: each lives batch_size steps.
        max_tokens = batch_size if mixed else args.steps * (2 * args.repeats + 2) + batch_size + 8
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.request_ids: list[str] = []

    def add(self) -> None:
        prompt = [self.rng.randrange(256) for _ in range(self.prompt_len)]
        self.request_ids.append(self.llm.processor.add_request(prompt, self.params))

    def start(self) -> None:
        for _ in range(1 if self.mixed else self.batch_size):
            self.add()
        for _ in range(self.batch_size + 4):  # the stream fills up / every prefill is done
            self.step()

    def step(self) -> None:
        if self.mixed:
            self.add()
        self.llm.processor.step(stream=False)

    def drain(self) -> None:
        for request_id in self.request_ids:
            self.llm.processor.abort_request(request_id)
        while self.llm.processor.has_unfinished_requests():
            self.llm.processor.step(stream=False)


def measure_row(llm: LLM, batch_size: int, mixed: bool, args: argparse.Namespace) -> dict:
    workload = Workload(llm, batch_size, mixed, args)
    workload.start()
    runs = []
    for _ in range(args.repeats):
        gc.collect()
        start = NOW()
        for _ in range(args.steps):
            workload.step()
        plain = (NOW() - start) / args.steps * 1e6
        clock = Clock()
        with instrumented(llm, clock, args.attention):
            clock.enabled = True
            start = NOW()
            for _ in range(args.steps):
                workload.step()
            clock.enabled = False
            instrumented_seconds = NOW() - start
        runs.append((plain, parts_per_step(clock, instrumented_seconds, args.steps)))
    if args.cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            workload.step()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)
    workload.drain()
    plain, parts = min(runs, key=lambda run: run[0])
    return {"kind": "mixed" if mixed else "decode", "batch_size": batch_size,
            "step_us": plain, "parts_us": parts}  # fmt: skip


def print_rows(rows: list[dict], num_layers: int) -> None:
    header = ["row", "step", "host", *PARTS, "per layer"]
    print(" | ".join(f"{name:>12}" for name in header))
    for row in rows:
        parts = row["parts_us"]
        forward = ("replay", "split op", "stitch", "dispatch")
        per_layer = sum(parts[part] for part in forward) / num_layers
        host = row["step_us"] - parts["sim device"]
        cells = [f"{row['kind']} {row['batch_size']}", f"{row['step_us']:.0f}", f"{host:.0f}"]
        cells += [f"{parts[part]:.0f}" for part in PARTS] + [f"{per_layer:.1f}"]
        print(" | ".join(f"{cell:>12}" for cell in cells))
    print("(us per step; step: uninstrumented; parts: an instrumented run of the same steps)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--mixed", action="store_true", help="also time mixed steps")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--attention", choices=["triton-stub", "torch"], default="triton-stub")
    parser.add_argument(
        "--mode",
        choices=["piecewise", "full"],
        default="piecewise",
        help="the graphs every step replays: PIECEWISE pieces, or FULL graphs (the general FULL "
        "graph for mixed steps: the host time a mixed step would take routed to FULL graphs)",
    )
    parser.add_argument(
        "--replay",
        choices=["skip", "simulate"],
        default="skip",
        help="skip: a replay returns the captured outputs (the default); simulate: simgraph's "
        "replay re-runs the piece (the CPU's stand-in for device work)",
    )
    parser.add_argument("--backend", default="eager", help="compile backend (eager | inductor)")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if current_platform().name != "simgraph":
        raise SystemExit("run with PIECEWORKS_PLATFORM=simgraph (examples/pieceworks-simgraph)")
    torch.set_num_threads(1)  # the host path, not an OpenMP pool, is what is measured
    batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    hf_config = {**get_preset("smollm2-135m-random"), **TINY_WIDTH}
    hf_config["num_hidden_layers"] = args.layers
    # Graphs up to the largest mixed step (every decode plus one prompt), so that no row runs
    # without graphs.
    max_tokens = max(batch_sizes) + 1 + args.prompt_len  # max_num_seqs decodes, one prompt
    capture_sizes = [1, 2, 4, *range(8, max_tokens + 8, 8)]
    with tempfile.TemporaryDirectory() as workdir:
        llm = LLM(
            str(random_hf_checkpoint(hf_config, Path(workdir) / "smollm2-shape")),
            compilation_config=compilation_for_mode(
                args.mode, {"backend": args.backend, "cudagraph_capture_sizes": capture_sizes}
            ),
            max_num_seqs=max(batch_sizes) + 1,
            max_model_len=args.steps * (2 * args.repeats + 2)
            + max(batch_sizes)
            + args.prompt_len
            + 64,
            dtype="float32",
        )
        num_layers = use_attention(llm, args.attention)
        if args.replay == "skip":
            skip_replayed_work()
        rows = [measure_row(llm, size, False, args) for size in batch_sizes]
        if args.mixed:
            rows += [measure_row(llm, size, True, args) for size in batch_sizes]
        llm.engine.shutdown()
    print(
        f"{num_layers} layers, tiny width, {args.mode} graphs, attention {args.attention}, "
        f"replay {args.replay}"
    )
    print_rows(rows, num_layers)
    if args.out:
        meta = {"layers": num_layers, "attention": args.attention, "backend": args.backend}
        Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
