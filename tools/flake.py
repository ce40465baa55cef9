"""Hunt flaky exercise checks: run every check in both directions N times, each on fresh random inputs.

    make flake N=300                                    # every check of every chapter, 300 times each way
    .venv/bin/python tools/flake.py -n 20 -k ch04       # only the checks whose name holds "ch04"

A check draws fresh random cases on every call (`llmlab.checks.fresh_rng`), so N calls are N independent draws.
The answers are the tables the check tests use, `ANSWERS` in tests/test_checks_chNN.py (tests/check_answers.py):
run i of a check tries its reference answer i mod R, which must pass, and its planted mistake i mod M, which must
fail with the message its test expects. The multi-rank checks (2.1, 2.2, 3.1, 4.1, 4.2) share one persistent gloo
`Cluster` for the whole hunt (`llmlab.checks.cluster`), so a call costs milliseconds, not a start of ranks.

Prints one row per check as it finishes: runs, reference failures, mistakes missed, seconds; then each chapter's
and the total, and the first message of every failure. Exit status 1 if anything failed, else 0.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmlab import checks

TESTS = Path(__file__).resolve().parent.parent / "tests"
CHAPTERS = tuple(f"ch{n:02d}" for n in range(1, 9))


@dataclass
class Tally:
    """What N runs of one check came to."""

    name: str  # "ch04.ring_time"
    runs: int = 0
    reference_failures: int = 0
    mistakes_missed: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)  # what went wrong, one line each (the first few kept)

    @property
    def failed(self) -> int:
        return self.reference_failures + self.mistakes_missed


def answers(chapters=CHAPTERS, only: str = "") -> dict[str, tuple[list, list]]:
    """{"ch04.ring_time": (references, mistakes)} from the chapters' ANSWERS tables, in table order; `only` keeps
    the checks whose name holds it."""

    if str(TESTS) not in sys.path:  # before the first Cluster starts: its ranks import the answers' modules too
        sys.path.insert(0, str(TESTS))
    from check_answers import Mistake  # tests/ is on the path now

    table: dict[str, tuple[list, list]] = {}
    for chapter in chapters:
        for answer in importlib.import_module(f"test_checks_{chapter}").ANSWERS:
            name = f"{chapter}.{answer.check.__name__}"
            if only in name:
                table.setdefault(name, ([], []))[isinstance(answer, Mistake)].append(answer)
    return table


def hunt(name: str, references: list, mistakes: list, n: int) -> Tally:
    """Run reference i mod R and mistake i mod M of one check, for i < n."""

    from check_answers import judge  # tests/ is on the path once answers() has run

    tally = Tally(name)
    start = time.perf_counter()
    for i in range(n):
        for kind, pool in (("reference", references), ("mistake", mistakes)):
            if not pool:
                continue
            try:
                wrong = judge(pool[i % len(pool)])
            except Exception as e:  # the check itself broke (not a verdict): a failure as well
                wrong = f"the check raised {type(e).__name__}: {e}"
            if not wrong:
                continue
            if kind == "reference":
                tally.reference_failures += 1
            else:
                tally.mistakes_missed += 1
            if len(tally.failures) < 3:
                tally.failures.append(f"run {i}, {kind} {i % len(pool)}: {wrong}")
        tally.runs += 1
    tally.seconds = time.perf_counter() - start
    return tally


def row(name: str, runs: int, reference_failures: int, mistakes_missed: int, seconds: float) -> str:
    return f"{name:<32} {runs:>6} {reference_failures:>10} {mistakes_missed:>10} {seconds:>9.1f}"


def report(tallies: list[Tally], out=None) -> int:
    """Print each chapter's sums, the total and every failure's first messages to `out` (None: stdout); return the
    exit status."""

    print("-" * 71, file=out)
    chapters = sorted({t.name.split(".")[0] for t in tallies})
    for chapter in chapters + ["total"]:
        mine = [t for t in tallies if chapter == "total" or t.name.startswith(chapter + ".")]
        print(row(chapter, sum(t.runs for t in mine), sum(t.reference_failures for t in mine),
                  sum(t.mistakes_missed for t in mine), sum(t.seconds for t in mine)), file=out)
    failed = [t for t in tallies if t.failed]
    for t in failed:
        print(f"\n{t.name}: {t.reference_failures} reference failure(s), {t.mistakes_missed} mistake(s) missed",
              file=out)
        for line in t.failures:
            print(f"  {line}", file=out)
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=300, help="runs of each check, each way (default 300)")
    parser.add_argument("-k", default="", metavar="TEXT", help="only the checks whose name (ch04.ring_time) holds it")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error(f"-n must be at least 1, got {args.n}")
    table = answers(only=args.k)
    if not table:
        parser.error(f"-k {args.k!r} matches no check; names look like ch04.ring_time")

    # one thread, as the check tests run (tests/conftest.py's one_thread): the checks' tensors are tiny, and on a
    # shared 2-core machine a second OpenMP thread made them several times slower; no check's verdict may depend
    # on the order of a sum, which the thread count changes
    torch.set_num_threads(1)
    print(f"{len(table)} checks, {args.n} runs each way (reference i mod R passes, mistake i mod M is named)")
    print(f"{'check':<32} {'runs':>6} {'ref fails':>10} {'missed':>10} {'seconds':>9}")
    tallies = []
    try:
        for name, (references, mistakes) in table.items():
            tally = hunt(name, references, mistakes, args.n)
            print(row(name, tally.runs, tally.reference_failures, tally.mistakes_missed, tally.seconds), flush=True)
            tallies.append(tally)
    finally:
        checks.close_clusters()
    return report(tallies)


if __name__ == "__main__":
    sys.exit(main())
