"""Where a static-loop peer's decode step goes: per-step time and a kernel table, by variant.

Builds the ``gpt_fast`` loop and the HF ``static_compiled`` loop of a preset shape with random
weights on the device (no checkpoint on disk), compiles each variant's one-token step with
Inductor (reduce-overhead), and prints for each: the median step with a device sync around every
step (how ``bench latency`` times peers), the step with no sync between steps (host launches
overlapping the device), the device-busy time, and the kernels taking most device time.

Variants: ``gpt_fast:<attention>[+qkv][+cdt]`` (attention ``flex`` or ``sdpa``, ``+qkv`` one
q/k/v matmul, ``+cdt`` Inductor's coordinate-descent tuning) and ``static:<attention>[+qkv]``
(``gqa``: pieceworks' folded-GQA SDPA registered with transformers, or any
``attn_implementation`` transformers knows, e.g. ``flex_attention``, ``sdpa``; ``+qkv`` one q/k/v
matmul, as ``bench latency``'s ``static_compiled`` runs).

    python benchmarks/profile_peers.py --model llama-3.1-8b --batch-size 1 \\
        --variants gpt_fast:sdpa,gpt_fast:flex+qkv,static:gqa,static:gqa+qkv \\
        --output-json peers.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from pieceworks.benchmarks.device_busy import profile_device_busy
from pieceworks.benchmarks.peers.gpt_fast import GptFastDecoder
from pieceworks.benchmarks.peers.gpt_fast_model import GptFastLlama
from pieceworks.benchmarks.peers.static_compiled import StaticCacheDecoder
from pieceworks.models.loading.presets import get_preset


def _random_(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)


def build(variant: str, hf_config: dict[str, Any], batch: int, max_len: int) -> tuple[Any, Any]:
    """The decoder of ``variant`` and a function that empties its cache."""
    kind, _, spec = variant.partition(":")
    attention, *flags = spec.split("+")
    torch._inductor.config.coordinate_descent_tuning = "cdt" in flags
    device = torch.device("cuda")
    if kind == "gpt_fast":
        model = GptFastLlama.empty(hf_config, torch.bfloat16, device)
        _random_(model)
        if "qkv" in flags:
            model.fuse_qkv()
        model.setup_caches(batch, max_len, attention)
        return GptFastDecoder(model.eval().requires_grad_(False)), lambda: None
    if kind == "static":
        import transformers

        config = transformers.LlamaConfig(**hf_config)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        _random_(model)
        if attention != "gqa":
            model.set_attn_implementation(attention)
        decoder = StaticCacheDecoder(
            model.eval(), max_len, gqa=attention == "gqa", fuse_qkv="qkv" in flags
        )
        return decoder, decoder.reset
    raise ValueError(f"unknown variant {variant!r}: gpt_fast:<attention>... or static:<attention>")


def measure(decoder: Any, reset: Any, input_ids: torch.Tensor, steps: int) -> dict[str, Any]:
    reset()
    start = time.perf_counter()
    decoder.generate(input_ids, 4)  # compile, capture
    compile_s = time.perf_counter() - start
    reset()
    first, position = decoder.prefill(input_ids)
    synced: list[float] = []
    decoder.decode(first, position, steps, synced)
    reset()
    first, position = decoder.prefill(input_ids)
    torch.cuda.synchronize()
    start = time.perf_counter()
    decoder.decode(first, position, steps)
    torch.cuda.synchronize()
    pipelined_ms = (time.perf_counter() - start) * 1e3 / steps
    reset()
    first, position = decoder.prefill(input_ids)
    busy = profile_device_busy(lambda: decoder.decode(first, position, 8), 8)
    reset()
    first, position = decoder.prefill(input_ids)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        decoder.decode(first, position, 5)
        torch.cuda.synchronize()
    kernels = sorted(profiler.key_averages(), key=lambda e: -e.device_time_total)[:14]
    return {
        "compile_s": compile_s,
        "synced_step_ms": statistics.median(synced) * 1e3,
        "pipelined_step_ms": pipelined_ms,
        "device_busy_ms": busy["device_busy_ms"],
        "kernels_us_per_step": [
            {"name": e.key[:110], "calls_per_step": e.count / 5, "us": e.device_time_total / 5}
            for e in kernels
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument(
        "--variants", default="gpt_fast:sdpa,gpt_fast:flex+qkv,static:gqa,static:gqa+qkv"
    )
    parser.add_argument("--output-json")
    args = parser.parse_args()
    hf_config = get_preset(args.model)
    max_len = args.input_len + args.steps + 8
    results = {}
    for variant in args.variants.split(","):
        torch.compiler.reset()
        torch.manual_seed(0)
        input_ids = torch.randint(0, hf_config["vocab_size"], (args.batch_size, args.input_len),
                                  device="cuda")  # fmt: skip
        try:
            decoder, reset = build(variant, hf_config, args.batch_size, max_len)
            result = measure(decoder, reset, input_ids, args.steps)
        except Exception as error:  # one variant failing must not lose the others
            result = {"error": f"{type(error).__name__}: {error}"[:2000]}
        decoder = reset = None
        torch.cuda.empty_cache()
        results[variant] = result
        print(f"== {variant} (batch {args.batch_size}, context {args.input_len})")
        if "error" in result:
            print("   failed:", result["error"][:600])
        else:
            print(f"   synced {result['synced_step_ms']:.3f} ms/step, pipelined "
                  f"{result['pipelined_step_ms']:.3f}, device busy {result['device_busy_ms']:.3f}, "
                  f"compile {result['compile_s']:.1f} s")  # fmt: skip
            for kernel in result["kernels_us_per_step"]:
                calls = kernel["calls_per_step"]
                print(f"   {kernel['us']:9.1f} us  x{calls:5.1f}  {kernel['name']}")
        if args.output_json:
            with open(args.output_json, "w") as file:
                json.dump({"args": vars(args), "torch": torch.__version__, "results": results},
                          file, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
