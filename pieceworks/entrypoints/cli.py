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
    with ``--kernels``, each kernel op's implementation there and why the others were not."""
    from pieceworks.platforms import describe_platform_resolution

    print(describe_platform_resolution())
    if args.kernels:
        from pieceworks.entrypoints.run import format_kernel_choices
        from pieceworks.kernels.chooser import describe_kernel_choices

        print(format_kernel_choices(describe_kernel_choices()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pieceworks", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", required=True)
    platforms = sub.add_parser("platforms", help="show the platforms probed and the one chosen")
    platforms.add_argument(
        "--kernels", action="store_true", help="also show each kernel op's implementation and why"
    )
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
