"""Probe: what the greedy argmax costs after the LM head, torch's form against the Triton kernel.

Inside one CUDA graph (``gemv_decode.graph_time_us``), for the 8B vocabulary at 1 and 64 rows,
microseconds per call of:
- ``lm_head``: the bfloat16 LM head alone (``F.linear``, 128256 x 4096);
- ``lm_head+torch``: then what the sampler ran before session 15: the float32 cast and
  ``chunked_argmax`` (pad, chunk maxima, argmax of the maxima, gather, index arithmetic);
- ``lm_head+kernel B/W``: then ``launch_row_argmax`` with ``B`` columns per block and ``W`` warps.
The argmax's cost is the difference to ``lm_head``; the LM head leaves the logits in L2, as in
a step. Each variant's ids are checked against ``torch.argmax`` first.

Run (CUDA machine): PYTHONPATH=. python benchmarks/argmax_probe.py --out probe.json
"""

import argparse
import json

import torch
import torch.nn.functional as F
from gemv_decode import graph_time_us  # benchmarks/ is on sys.path when run as a script

from pieceworks.engine import triton_argmax
from pieceworks.engine.sampler import chunked_argmax

VOCAB_SIZE, HIDDEN_SIZE = 128256, 4096
CONFIGS = [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]


def kernel_variant(block: int, warps: int):
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        triton_argmax.ARGMAX_BLOCK, triton_argmax.ARGMAX_WARPS = block, warps
        return triton_argmax.launch_row_argmax(logits)

    return argmax


def rows_for(num_rows: int, replays: int) -> list[dict]:
    weight = torch.randn(VOCAB_SIZE, HIDDEN_SIZE, device="cuda", dtype=torch.bfloat16) * 0.02
    hidden = torch.randn(num_rows, HIDDEN_SIZE, device="cuda", dtype=torch.bfloat16)
    logits = F.linear(hidden, weight)
    expected = logits.float().argmax(dim=-1)
    variants = {"lm_head": None, "lm_head+torch": lambda x: chunked_argmax(x.float())}
    variants |= {f"lm_head+kernel {b}/{w}": kernel_variant(b, w) for b, w in CONFIGS}
    results = []
    for name, argmax in variants.items():
        if argmax is not None:
            assert torch.equal(argmax(logits), expected), name
        out = torch.empty_like(logits)

        def step(argmax=argmax, out=out):
            torch.matmul(hidden, weight.t(), out=out)
            if argmax is not None:
                argmax(out)

        us = graph_time_us([step], replays)
        results.append({"rows": num_rows, "variant": name, "us_per_call": us})
        print(f"rows {num_rows:3d} {name:24s} {us:8.2f} us", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args()
    results = [row for num_rows in (1, 64) for row in rows_for(num_rows, args.replays)]
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
