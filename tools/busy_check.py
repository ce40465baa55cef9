"""The busy-machine check: build the chapters' pages twice — quiet, then beside busy processes — and compare them.

The workbook's pages print what was measured where they were built; on a busy machine (a laptop with a browser
and a video call) a timed figure may spread too wide to decide, and then it must say so, never flip. This tool
builds every chapter with `llmlab.site` into OUT/quiet, then again into OUT/busy while `--busy` processes spin
on the CPU (`while True: pass`, each bounded in time as well and always killed at the end, on an error or Ctrl-C
too), and fails when:

- a claim's verdict in the busy build differs from the quiet build's, neither of them reading
  "inconclusive here (busy machine)" (`llmlab.claims.INCONCLUSIVE`), or a claim is in one build only;
- a page of either build shows an `InvariantWarning` (a measured figure broke a rule its chapter relies on);
- a page of either build shows a frozen progress bar (one stopped short of its total);
- a chapter fails in either build, or runs over its 60 s budget in the quiet one.

It prints one report: per chapter the seconds and the load of both builds, the verdicts side by side, and the
problems; the exit status is 1 when there is any problem. It takes a while (every chapter twice, the second run
slowed by the busy processes) and loads the machine: it is `make busy-check`, not part of `make test`.

    .venv/bin/python tools/busy_check.py                              # every chapter, 2 busy processes
    .venv/bin/python tools/busy_check.py --chapters 01 06 --busy 2 --out /tmp/busy-check

The rules are functions of two pages' HTML (`verdicts`, `page_problems`, `compare_pages`), tested on small
synthetic pages in tests/test_busy_check.py.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

from llmlab import site
from llmlab.claims import INCONCLUSIVE, ClaimsTable
from llmlab.tables import format_table

BUDGET_S = 60.0  # a chapter's wall-time budget on a quiet 2-core machine (README, "Tests")
_OUTPUT_CLASS = "jp-OutputArea-output"  # the class of a cell output's element in nbconvert's lab template
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
_WARNING = re.compile(r"InvariantWarning: (.+)")


class _Outputs(HTMLParser):
    """The text and the tables (rows of cell texts) of a page's cell outputs; code and markdown are skipped."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.text: list[str] = []
        self.tables: list[list[list[str]]] = []
        self._depth = 0  # elements open inside the current output (0: not in an output)
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag in _VOID:
            return
        if self._depth:
            self._depth += 1
        elif _OUTPUT_CLASS in (dict(attrs).get("class") or "").split():
            self._depth = 1
        if not self._depth:
            return
        if tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("td", "th") and self.tables and self.tables[-1]:
            self._cell = []

    def handle_endtag(self, tag):
        if tag in _VOID or not self._depth:
            return
        self._depth -= 1
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data):
        if self._depth:
            self.text.append(data)
            if self._cell is not None:
                self._cell.append(data)


def _outputs(page_html: str) -> _Outputs:
    parser = _Outputs()
    parser.feed(page_html)
    parser.close()
    return parser


def verdicts(page_html: str) -> dict[str, str]:
    """{claim id: verdict} of every claims table (`claims.table(N)`'s HTML) among the page's outputs."""
    found = {}
    for table in _outputs(page_html).tables:
        if table and tuple(table[0]) == ClaimsTable.HEADER:
            found.update((row[0], row[-1]) for row in table[1:] if len(row) == len(ClaimsTable.HEADER))
    return found


def page_problems(name: str, page_html: str) -> list[str]:
    """The InvariantWarnings and the frozen progress bars among a page's outputs, each naming the page."""
    text = "".join(_outputs(page_html).text)
    return ([f"{name}: InvariantWarning: {m[1].strip()}" for m in _WARNING.finditer(text)]
            + [f"{name}: a frozen progress bar: {bar!r}" for bar in site.frozen_bars(text)])


def compare_pages(name: str, quiet_html: str, busy_html: str) -> list[str]:
    """Problems between a chapter's quiet and busy pages: each page's own (`page_problems`), then every claim decided
    differently by the two builds, or that is in one build only.

    A verdict of INCONCLUSIVE in either build is no contradiction: it says that build's rounds could not decide. The
    busy build may read it where the quiet one decided (the point of the rule); the quiet one may read it too, when
    its own ranks load the 2 cores and a figure sits on the edge of a verdict (C12's crossover near the sweep's
    largest size), and then the busy build's verdict has nothing to contradict."""
    problems = page_problems(f"{name} (quiet)", quiet_html) + page_problems(f"{name} (busy)", busy_html)
    quiet, busy = verdicts(quiet_html), verdicts(busy_html)
    for claim in sorted(quiet.keys() | busy.keys()):
        q, b = quiet.get(claim), busy.get(claim)
        if q is None or b is None:
            problems.append(f"{name}: {claim} is in the {'busy' if q is None else 'quiet'} build only")
        elif b != q and INCONCLUSIVE not in (q, b):
            problems.append(f"{name}: {claim} reads {b!r} in the busy build but {q!r} in the quiet one")
    return problems


def run_problems(page: site.Page, build: str, budget_s: float | None) -> list[str]:
    """A chapter that failed in `build`, or (when `budget_s` is given) that ran over it."""
    problems = [f"{page.html.name} ({build}): failed: {page.problem}"] if page.problem else []
    if budget_s is not None and page.seconds > budget_s:
        problems.append(f"{page.html.name} ({build}): ran {page.seconds:.0f} s, over its {budget_s:.0f} s budget")
    return problems


def report(quiet: list[site.Page], busy: list[site.Page], busy_processes: int) -> tuple[str, list[str]]:
    """The printed report of both builds and the list of problems (empty: the check passed)."""
    problems, runs, claims = [], [], []
    for q, b in zip(quiet, busy, strict=True):
        quiet_html, busy_html = q.html.read_text(encoding="utf-8"), b.html.read_text(encoding="utf-8")
        problems += run_problems(q, "quiet", BUDGET_S) + run_problems(b, "busy", None)
        problems += compare_pages(q.html.name, quiet_html, busy_html)
        runs.append({"chapter": q.html.name, "quiet s": f"{q.seconds:.0f}", "quiet load": str(q.load),
                     "busy s": f"{b.seconds:.0f}", "busy load": str(b.load)})
        qv, bv = verdicts(quiet_html), verdicts(busy_html)
        claims += [{"claim": c, "chapter": q.html.stem, "quiet": qv.get(c, "—"), "busy": bv.get(c, "—")}
                   for c in sorted(qv.keys() | bv.keys(), key=lambda c: int(c.lstrip("C")) if c[1:].isdigit() else 0)]
    lines = [f"busy-machine check: every chapter built quiet, then beside {busy_processes} busy processes", "",
             str(format_table(runs)), "", str(format_table(claims)), "",
             f"{len(problems)} problem{'s' * (len(problems) != 1)}" + (":" if problems else ": the check passed"),
             *(f"- {p}" for p in problems)]
    return "\n".join(lines), problems


def chapters(selected: list[str] | None, folder: Path = Path("chapters")) -> list[Path]:
    """The chapter notebooks: all of `folder`'s NN_*.ipynb, or those whose name starts with one of `selected`
    ("01", "06_tuning") or that it names as a path."""
    found = sorted(folder.glob("[0-9]*.ipynb"))
    if not selected:
        if not found:
            raise FileNotFoundError(f"no {folder}/NN_*.ipynb: run from the project root")
        return found
    picked = []
    for s in selected:
        matches = [Path(s)] if Path(s).suffix == ".ipynb" and Path(s).is_file() else [
            p for p in found if p.name.startswith(s)]
        if not matches:
            raise ValueError(f"--chapters {s!r} names no notebook in {folder}/ ({', '.join(p.name for p in found)})")
        picked += [p for p in matches if p not in picked]
    return picked


def _spin(count: int, seconds: float) -> list[subprocess.Popen]:
    """`count` processes that keep a core busy for at most `seconds` (so none outlives a killed check)."""
    code = f"import time\nend = time.monotonic() + {seconds:.0f}\nwhile time.monotonic() < end: pass"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]


def _stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        p.kill()
    for p in processes:
        p.wait()


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # on SIGTERM unwind like Ctrl-C, so the busy processes are killed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chapters", nargs="+", metavar="NN", help="chapters to build (e.g. 01 06): default all")
    parser.add_argument("--out", default="build/busy-check", help="folder for the quiet/ and busy/ builds")
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside the second build (default 2)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for each chapter (as `llmlab site`)")
    args = parser.parse_args(argv)
    if args.busy < 1:
        parser.error(f"--busy={args.busy} must be at least 1")
    try:
        notebooks = chapters(args.chapters)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    out = Path(args.out)
    signal.signal(signal.SIGTERM, _terminate)
    print(f"quiet build → {out / 'quiet'}")
    quiet = site.build(notebooks, out / "quiet", timeout=args.timeout)
    print(f"busy build beside {args.busy} busy processes → {out / 'busy'}")
    spinning = _spin(args.busy, len(notebooks) * args.timeout + 60)
    try:
        busy = site.build(notebooks, out / "busy", timeout=args.timeout)
    finally:
        _stop(spinning)
    text, problems = report(quiet, busy, args.busy)
    print(text)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
