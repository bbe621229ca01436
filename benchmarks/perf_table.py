"""Print the current-numbers table of ``docs/performance.md`` from ``bench latency`` JSON files.

One markdown row per pieceworks mode and batch size of each file, with that batch's peers of the
same run, the commit, date, device, versions and the command that reproduces the file; where a
file has speculative rows, a second table pairs each with its run without speculation (output
tokens per second, their ratio, acceptance):

    python benchmarks/perf_table.py docs/bench/*.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pieceworks.benchmarks.report import format_performance_table, read_latency_json  # noqa: E402
from pieceworks.benchmarks.spec_report import format_speculative_table  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="bench latency --output-json files")
    args = parser.parse_args()
    payloads = read_latency_json(args.files)
    print(format_performance_table(payloads))
    speculative = format_speculative_table(payloads)
    if speculative:
        print("\nSpeculative decoding (output tokens per second, with and without):\n")
        print(speculative)
    return 0


if __name__ == "__main__":
    sys.exit(main())
