"""Per-layer kernel spans of an FP8 Llama decode step, from ``profile_decode.py``'s Chrome trace.

Under PDL a kernel starts (is scheduled) while the one before it still runs and waits inside, so
a kernel's own duration includes its wait. What adds up to a decoder layer is the time from each
kernel's start to the next kernel's start; this prints that median for the eight kernels of an
FP8 Llama layer (two norm + quant kernels, qkv, attention split and reduce, o_proj, gate_up,
down), the kernels' own durations, and their sum. Kernels are told apart by name and by the
kernel before them (the four GEMVs share one name, and so do the fused op's two norm kernels).

Run: python benchmarks/layer_spans.py prof/trace_full_and_piecewise_b1.json.gz
"""

import argparse
import collections
import gzip
import json
import statistics

KINDS = [  # a substring of the kernel name, and what it is
    ("_resident_gemv", "gemv"),
    ("_gemv", "gemv"),
    ("split_kv", "split"),
    ("_decode_reduce", "reduce"),
    ("rope_linear", "norm1"),  # Inductor names its norm kernel after the op it feeds
    ("silu_and_mul", "norm2"),
    ("_rms_norm_quant", "norm"),  # the fused op's kernel (enable_fusion): norm1 or norm2
    ("nvjet", "lm_head"),
]
GEMV_AFTER = {"norm1": "qkv", "reduce": "o", "split": "o", "norm2": "gate_up", "gate_up": "down"}
LAYER = ["norm1", "qkv", "split", "reduce", "o", "norm2", "gate_up", "down"]


def kind(name: str) -> str:
    return next((short for key, short in KINDS if key in name), name[:40])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", help="trace_<mode>_b<batch>.json.gz from profile_decode.py")
    args = parser.parse_args()
    events = json.load(gzip.open(args.trace))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    labels: list[str] = []  # each kernel named by its kind and the label before it
    for event in kernels:
        before = labels[-1] if labels else None
        label = kind(event["name"])
        if label == "gemv":
            label = GEMV_AFTER.get(before, "gemv?")
        elif label == "norm":
            label = "norm2" if before == "o" else "norm1"
        labels.append(label)
    durations, spans = collections.defaultdict(list), collections.defaultdict(list)
    for i in range(len(kernels) - 1):
        durations[labels[i]].append(kernels[i]["dur"])
        spans[labels[i]].append(kernels[i + 1]["ts"] - kernels[i]["ts"])
    total = 0.0
    for label in LAYER:
        span = statistics.median(spans[label])
        total += span
        print(
            f"{label:8s} n={len(spans[label]):5d} own {statistics.median(durations[label]):6.2f} us"
            f"  start to next start {span:6.2f} us"
        )
    print(f"layer {total:.2f} us")


if __name__ == "__main__":
    main()
