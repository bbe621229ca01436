"""Device time of a decode step with no host work between steps: its graphs replayed back to back.

Builds the engine (FULL_AND_PIECEWISE, ``max_num_seqs`` = the batch size), decodes a few greedy
steps so every graph exists, then replays the FULL decode graph of the batch size and its first
decode tail (``engine/decode_tail.py``) 200 times between two device events. The result is the
step time the device needs when the host never makes it wait: a decode step that ``bench
latency`` measures longer than this spends the difference waiting for the host; the difference
between this and the profiler's device-busy time is the gaps between kernels inside the graphs.
Needs a device with static graphs.

    python benchmarks/decode_replay.py --model llama-125m --batch-sizes 1,8,64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pieceworks.core.forward_context import BatchDescriptor  # noqa: E402
from pieceworks.engine.llm import LLM  # noqa: E402
from pieceworks.engine.sampling_params import SamplingParams  # noqa: E402
from pieceworks.platforms import current_platform  # noqa: E402

NUM_REPLAYS = 200


def replay_ms_per_step(model: str, batch_size: int, num_scheduler_steps: int) -> float:
    """Milliseconds per decode step of ``batch_size`` rows, graphs replayed back to back."""
    llm = LLM(
        model,
        compilation_config={"level": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"},
        max_num_seqs=batch_size,
        num_scheduler_steps=num_scheduler_steps,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate([[1, 2, 3]] * batch_size, greedy)
    runner = llm.engine.runner
    descriptor = BatchDescriptor(batch_size, uniform_decode=True)
    graphs = [runner.forward_model.entries[descriptor].graph]
    graphs += [tail.entries[descriptor].graph for tail in runner.decode_tails[:1]]
    platform = current_platform()
    for _ in range(20):
        for graph in graphs:
            graph.replay()
    start, end = platform.create_event(timing=True), platform.create_event(timing=True)
    start.record()
    for _ in range(NUM_REPLAYS):
        for graph in graphs:
            graph.replay()
    end.record()
    end.synchronize()
    llm.shutdown()
    return start.elapsed_time(end) / NUM_REPLAYS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-125m")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--num-scheduler-steps", type=int, default=1)
    args = parser.parse_args()
    for batch_size in (int(size) for size in args.batch_sizes.split(",")):
        ms = replay_ms_per_step(args.model, batch_size, args.num_scheduler_steps)
        print(f"{args.model} batch {batch_size}: {ms:.4f} ms per decode step, back to back")


if __name__ == "__main__":
    main()
