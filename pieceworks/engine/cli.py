"""The ``pieceworks`` command line: ``run``, ``generate``, ``bench latency``, ``platforms``.

Each subcommand is a small function taking the parsed arguments; engine construction and the
report live in their own modules so this file stays a thin layer over the Python API.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def cmd_platforms(args: argparse.Namespace) -> int:
    """Print every platform known, whether it is available and why not, and which resolved."""
    from pieceworks.platforms import describe_platform_resolution

    try:
        print(describe_platform_resolution())
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def _add_platforms(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("platforms", help="show the platforms probed and the one chosen")
    parser.set_defaults(func=cmd_platforms)


_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_platforms]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pieceworks", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add_subcommand in _SUBCOMMANDS:
        add_subcommand(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
