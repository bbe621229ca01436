"""The ``pieceworks`` command line: ``run``, ``generate``, ``chat``, ``serve``, ``bench``,
``platforms``.

Each subcommand lives in its own module of this package (``run``, ``generate``, ``chat``, ``serve``,
``bench``) as a small function over the Python API, registered here; engine arguments keep vLLM's
flag names (``--max-num-seqs``, ``--max-model-len``, ``-O``, ``--compilation-config '{json}'``,
``--enforce-eager``; ``engine_args``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pieceworks.entrypoints import bench, chat, generate, run, serve


def cmd_platforms(args: argparse.Namespace) -> int:
    """Print every platform known, whether it is available and why not, and which resolved;
    with ``--kernels``, each kernel op's implementation there and why the others were not;
    with ``--check [NAME]``, the conformance check's table (exit status 1 on a failure)."""
    from pieceworks.platforms import describe_platform_resolution

    if args.check is not None:
        return cmd_platform_check(args)
    print(describe_platform_resolution())
    if args.kernels:
        from pieceworks.entrypoints.run import format_kernel_choices
        from pieceworks.kernels.chooser import describe_kernel_choices

        print(format_kernel_choices(describe_kernel_choices()))
    return 0


def cmd_platform_check(args: argparse.Namespace) -> int:
    from pieceworks import platforms
    from pieceworks.entrypoints import platform_check
    from pieceworks.platforms.registry import platform_by_name

    name = args.check or None
    platform = platform_by_name(name) if name else platforms.current_platform()
    options = platform_check.CheckOptions(backend=args.backend)
    results = platform_check.run_checks(platform, options)
    header = platform.capabilities().describe()
    print(platform_check.format_table(platform.name, header, results))
    if args.output_json:
        platform_check.write_json(args.output_json, platform.name, header, results)
    return 0 if platform_check.passed(results) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pieceworks", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", required=True)
    platforms = sub.add_parser("platforms", help="show the platforms probed and the one chosen")
    platforms.add_argument(
        "--kernels", action="store_true", help="also show each kernel op's implementation and why"
    )
    platforms.add_argument(
        "--check",
        nargs="?",
        const="",
        metavar="NAME",
        help="run the conformance check on platform NAME (default: the resolved one)",
    )
    platforms.add_argument(
        "--backend", help="compile backend of the model checks (default: the platform's)"
    )
    platforms.add_argument("--output-json", metavar="PATH", help="also write the check's report")
    platforms.set_defaults(func=cmd_platforms)
    run.register(sub)
    generate.register(sub)
    chat.register(sub)
    serve.register(sub)
    bench.register(sub)
    return parser


# What a user's input can raise: a bad flag, config, checkpoint file or prompt. Anything else is
# a bug in pieceworks and keeps its traceback.
USER_ERRORS = (ValueError, TypeError, RuntimeError, OSError)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; a user error is one ``error:`` line on stderr and exit status 2
    (``--debug``, anywhere on the command line, shows its traceback instead)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    args = build_parser().parse_args([arg for arg in argv if arg != "--debug"])
    try:
        return args.func(args)
    except USER_ERRORS as error:
        if debug:
            raise
        print(f"error: {one_line(error)} (--debug shows the traceback)", file=sys.stderr)
        return 2


def one_line(error: BaseException) -> str:
    """The error's message on one line (an OSError without its own message names its file)."""
    text = str(error) or type(error).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
