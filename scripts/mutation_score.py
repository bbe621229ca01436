"""Per-module mutation score from mutmut's results and the list of judged mutants.

Reads ``mutmut results --all true`` (run from the repository root, after ``scripts/mutation.sh``)
and the judged survivors of docs/mutation_judged.md (its table rows
``| `<mutant>` | <verdict> | <why> |``, the verdict ``equivalent``, ``time`` or ``gpu``), and prints
a Markdown table (docs/testing.md, "Mutation testing"): per module the mutants tested, killed (a
test failed, timed out or crashed), judged, left, and killed over tested and over non-equivalent
(equivalent and time-only mutants are left out of the second denominator; GPU-only ones stay in
it, as survivors). Mutants not yet tested are counted apart; mutmut's "suspicious" counts as
survived.

Usage: python scripts/mutation_score.py [module prefix ...]   e.g. pieceworks.platforms
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

JUDGED_FILE = Path(__file__).parents[1] / "docs" / "mutation_judged.md"
KILLED = {"killed", "timeout", "segfault", "caught by type check"}
VERDICTS = ("equivalent", "time", "gpu")
JUDGED_ROW = re.compile(r"^\| `(?P<name>pieceworks\.[^`]+)` \| (?P<verdict>\w+) \| .+ \|$")
# "pieceworks.core.cache.cache_key.x_cache_directory__mutmut_3" -> "pieceworks.core.cache.cache_key"
MODULE = re.compile(r"^(?P<module>.+?)\.x(?:ǁ|_)")


def read_judged() -> dict[str, str]:
    """Mutant name -> verdict, from the judged-survivor table rows of JUDGED_FILE."""
    judged = {}
    for number, line in enumerate(JUDGED_FILE.read_text().splitlines(), 1):
        match = JUDGED_ROW.match(line)
        if match is None:
            continue
        if match["verdict"] not in VERDICTS:
            raise SystemExit(f"{JUDGED_FILE}:{number}: the verdict is one of {', '.join(VERDICTS)}")
        judged[match["name"]] = match["verdict"]
    return judged


def read_results() -> dict[str, str]:
    """Mutant name -> mutmut's status ("killed", "survived", "no tests", "not checked", ...)."""
    output = subprocess.run(
        [sys.executable, "-m", "mutmut", "results", "--all", "true"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    results = {}
    for line in output.splitlines():
        name, _, status = line.strip().rpartition(": ")
        if name:
            results[name] = status
    return results


def classify(name: str, status: str, judged: dict[str, str]) -> str:
    """untested, killed, the judged kind (equivalent, time, gpu), no tests or survived."""
    if status == "not checked":
        return "untested"
    if status in KILLED:
        return "killed"
    if name in judged:
        return judged[name]
    return "no tests" if status == "no tests" else "survived"


def tally(results: dict[str, str], judged: dict[str, str], prefixes: list[str]) -> dict:
    counts: dict[str, Counter] = defaultdict(Counter)
    for name, status in results.items():
        match = MODULE.match(name)
        module = match.group("module") if match else name
        if prefixes and not any(module.startswith(prefix) for prefix in prefixes):
            continue
        category = classify(name, status, judged)
        counts[module]["tested"] += category != "untested"
        counts[module][category] += 1
    return counts


def percent(numerator: int, denominator: int) -> str:
    return f"{100 * numerator / denominator:.1f} %" if denominator else "-"


def main() -> None:
    counts = tally(read_results(), read_judged(), sys.argv[1:])
    columns = ["tested", "killed", "equivalent", "time", "gpu", "survived", "no tests"]
    print(
        "| module | " + " | ".join(columns) + " | killed / tested | killed / non-equivalent |"
        " untested |"
    )
    print("| --- |" + " ---: |" * (len(columns) + 3))
    total: Counter = Counter()
    for module in sorted(counts):
        total.update(counts[module])
        print(row(module_path(module), counts[module]))
    print(row("total", total))


def module_path(module: str) -> str:
    """``pieceworks.core.cache.cache_key`` -> ``core/cache/cache_key.py``; a package -> its
    ``__init__.py``."""
    path = Path(*module.split("."))
    file = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    return str(file.relative_to("pieceworks"))


def row(label: str, count: Counter) -> str:
    cells = [count[key] for key in ("tested", "killed", "equivalent", "time", "gpu", "survived")]
    cells.append(count["no tests"])
    non_equivalent = count["tested"] - count["equivalent"] - count["time"]
    return (
        f"| `{label}` | "
        + " | ".join(str(cell) for cell in cells)
        + f" | {percent(count['killed'], count['tested'])}"
        + f" | {percent(count['killed'], non_equivalent)} | {count['untested']} |"
    )


if __name__ == "__main__":
    main()
