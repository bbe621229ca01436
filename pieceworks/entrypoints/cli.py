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
    """Print every platform known, whether it is available and why not, and which resolved."""
    from pieceworks.platforms import describe_platform_resolution

    print(describe_platform_resolution())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pieceworks", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("platforms", help="show the platforms probed and the one chosen").set_defaults(
        func=cmd_platforms
    )
    run.register(sub)
    generate.register(sub)
    chat.register(sub)
    serve.register(sub)
    bench.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
