"""Print the decode-step budget table of ``docs/performance.md`` from ``bench latency
--kernel-breakdown`` JSON files.

One markdown row per measured pieceworks mode and batch size: step ms, device-busy ms, the floor,
kernels per step and per decoder layer, the gap sum inside a step and the top 5 kernels with their
share of the step's kernel time:

    python benchmarks/kernel_table.py docs/bench/h100/small_*.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pieceworks.benchmarks.kernel_report import format_budget_table  # noqa: E402
from pieceworks.benchmarks.report import read_latency_json  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="bench latency --kernel-breakdown JSON files")
    args = parser.parse_args()
    payloads = read_latency_json(args.files)
    print(format_budget_table(payloads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
