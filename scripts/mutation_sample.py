"""A uniform random sample of the mutants of the modules that no mutation run has tested.

Reads the mutant names from mutmut's ``mutants/`` (the ``.meta`` file of each mutated module,
written by the first ``mutmut run``, e.g. ``bash scripts/mutation.sh`` with any glob), sorts the
names of the modules of ``pieceworks.core`` that no full run has tested (all but TESTED below),
and prints ``random.Random(SEED).sample(names, K)`` one name a line, in the sample's order; the
population size goes to stderr. ``--prefix P`` (repeatable) takes instead the untested modules
whose dotted name starts with P (a package, ``pieceworks.engine``, or a module). ``--seed N``
draws with another seed (default 20261203), and ``--exclude FILE`` leaves the names listed in
FILE (one a line) out of the population before drawing. With ``--score`` it prints instead the
sample's per-module counts from ``mutmut results`` and the judged mutants of docs/testing.md (as
``scripts/mutation_score.py`` reads them), and the score with its Wilson 95 % interval;
``--sample FILE`` scores the names listed in FILE instead of drawing them.
docs/testing.md, "A random sample of the untested core modules", "A second sample, after the
tests for the first", "A third sample, after the tests for the module gaps", "A random
sample of the untested engine modules" and "A second engine sample, after the tests for the
engine's gaps", records the results.

Usage: python scripts/mutation_sample.py [K]           (default 150; docs/mutation_sample.txt)
       bash scripts/mutation.sh $(python scripts/mutation_sample.py | sed -n 1,15p)
       python scripts/mutation_sample.py --score [K]
       python scripts/mutation_sample.py --seed 20261204 --exclude docs/mutation_sample.txt
                                                        (docs/mutation_sample_2.txt)
       python scripts/mutation_sample.py --score --sample docs/mutation_sample_2.txt
       cat docs/mutation_sample.txt docs/mutation_sample_2.txt > excluded.txt
       python scripts/mutation_sample.py --seed 20261205 --exclude excluded.txt
                                                        (docs/mutation_sample_3.txt)
       python scripts/mutation_sample.py --prefix pieceworks.engine --seed 20261206 100
                                                        (docs/mutation_sample_engine.txt)
       python scripts/mutation_sample.py --prefix pieceworks.engine --seed 20261207 \
           --exclude docs/mutation_sample_engine.txt 60  (docs/mutation_sample_engine_2.txt)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path

SEED = 20261203
K = 150
ROOT = Path(__file__).parents[1]
# The modules of core and engine that a full run has tested (docs/testing.md, "Score"): every
# population leaves them out.
TESTED = (
    "pieceworks.core.backend",
    "pieceworks.core.cache.cache_key",
    "pieceworks.core.cache.compile_cache",
    "pieceworks.core.cuda_graph",
    "pieceworks.core.cudagraph_dispatcher",
    "pieceworks.core.static_graph",
    "pieceworks.scheduler.block_manager",
    "pieceworks.worker.input_buffers",
    "pieceworks.scheduler.request",
    "pieceworks.worker.sampler",
    "pieceworks.scheduler.scheduler",
)


def population(prefixes: list[str] | None = None) -> list[str]:
    """Every mutant name of the untested modules under ``prefixes`` (by default core's), sorted."""
    return prefixed_population(prefixes or ["pieceworks.core"])


def prefixed_population(prefixes: list[str]) -> list[str]:
    """Every mutant name of the modules whose dotted name starts with a prefix, less TESTED."""
    mutants = ROOT / "mutants"
    names, matched = [], False
    for meta in sorted(mutants.glob("pieceworks/**/*.py.meta")):
        module = ".".join(meta.relative_to(mutants).with_suffix("").with_suffix("").parts)
        if not any(module.startswith(prefix) for prefix in prefixes):
            continue
        matched = True
        if module not in TESTED:
            names.extend(json.loads(meta.read_text())["exit_code_by_key"])
    if not matched:
        raise SystemExit(f"no .meta of {', '.join(prefixes)} in {mutants}: run mutmut once")
    return sorted(names)


def read_names(path: str) -> list[str]:
    """The mutant names listed in ``path``, one a line."""
    return [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]


def sample(
    k: int, seed: int = SEED, exclude: str | None = None, prefixes: list[str] | None = None
) -> list[str]:
    names = population(prefixes)
    if exclude is not None:
        excluded = set(read_names(exclude))
        missing = excluded.difference(names)
        if missing:
            raise SystemExit(f"{len(missing)} names of {exclude} are not in the population")
        names = [name for name in names if name not in excluded]
    print(f"population: {len(names)} mutants", file=sys.stderr)
    return random.Random(seed).sample(names, k)


def wilson(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95 % for z = 1.96)."""
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return centre - half, centre + half


def score(names: list[str]) -> None:
    """Per-module counts of the sample and its score, as mutation_score.py counts a mutant."""
    sys.path.insert(0, str(Path(__file__).parent))
    from mutation_score import MODULE, classify, module_path, read_judged, read_results

    results, judged = read_results(), read_judged()
    counts: dict[str, Counter] = defaultdict(Counter)
    for name in names:
        category = classify(name, results.get(name, "not checked"), judged)
        module = module_path(MODULE.match(name)["module"])  # type: ignore[index]
        counts[module]["sampled"] += 1
        counts[module]["tested"] += category != "untested"
        counts[module]["survived" if category == "no tests" else category] += 1
    columns = ["sampled", "tested", "killed", "equivalent", "time", "gpu", "survived"]
    print("| module | " + " | ".join(columns) + " |")
    print("| --- |" + " ---: |" * len(columns))
    total: Counter = Counter()
    for module in sorted(counts):
        total.update(counts[module])
        print(f"| `{module}` | " + " | ".join(str(counts[module][c]) for c in columns) + " |")
    print("| total | " + " | ".join(str(total[c]) for c in columns) + " |")
    non_equivalent = total["tested"] - total["equivalent"] - total["time"]
    if non_equivalent:
        low, high = wilson(total["killed"], non_equivalent)
        print(
            f"\nkilled / non-equivalent: {total['killed']} / {non_equivalent} = "
            f"{100 * total['killed'] / non_equivalent:.1f} % "
            f"(Wilson 95 %: {100 * low:.1f} % to {100 * high:.1f} %)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("k", nargs="?", type=int, default=K, help=f"sample size (default {K})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"default {SEED}")
    parser.add_argument("--exclude", metavar="FILE", help="names left out of the population")
    parser.add_argument("--sample", metavar="FILE", help="the names to score, instead of a draw")
    parser.add_argument(
        "--prefix",
        action="append",
        help="draw from the untested modules under this package or module (repeatable)",
    )
    parser.add_argument("--score", action="store_true", help="print the sample's score")
    args = parser.parse_args()
    if args.sample:
        names = read_names(args.sample)
    else:
        names = sample(args.k, args.seed, args.exclude, args.prefix)
    if args.score:
        score(names)
    else:
        print("\n".join(names))


if __name__ == "__main__":
    main()
