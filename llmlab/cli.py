"""The `llmlab` command.

    llmlab doctor                      check this machine: tier, versions, FLOP/s, bandwidth, ranks, Triton
    llmlab exercises build             write exercises/ from solutions/
    llmlab exercises check             fail when exercises/ is stale
    llmlab grade NOTEBOOK [--json]     run a learner's notebook against its chapter's official checks
    llmlab grade --all                 every chapter's exercises: passed / total per chapter
    llmlab bench NAME [--json PATH]    run a benchmark (see `llmlab bench --help`)
    llmlab results [--check]           write README's results tables from results/*.json
    llmlab train [FLAGS]               the capstone: compose DP/ZeRO/TP/... by flags (see `llmlab train --help`)
    llmlab site [NOTEBOOK ...]         execute the chapters and write HTML pages with their outputs (site/)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llmlab import files


def _doctor(args) -> int:
    from llmlab.doctor import main  # imported on use: `llmlab --help` stays fast

    return main()


def _exercises(args) -> int:
    from llmlab.exercises import notebooks  # imported on use: `llmlab --help` stays fast

    root = Path(args.root)
    if args.action == "build":
        for path in notebooks.build(root, force=args.force):
            print(f"wrote {path}")
        return 0
    problems = notebooks.check(root)
    for p in problems:
        print(p)
    if problems:
        print("exercises/ is out of date: run `llmlab exercises build`", file=sys.stderr)
        return 1
    print("exercises/ is up to date with solutions/")
    return 0


def _grade(args) -> int:
    from llmlab.exercises import grade, sandbox  # imported on use: `llmlab --help` stays fast

    if args.memory is not None and not args.memory > 0:
        raise ValueError(f"--memory {args.memory:g}: must be a positive number of GiB")
    memory = None if args.memory is None else int(args.memory * 2**30)
    if args.all == (args.notebook is not None):
        raise ValueError("name one NOTEBOOK, or --all for every chapter's exercises")
    if args.all and (args.solution or args.report):
        raise ValueError("--all grades each chapter against its own solution and writes no --report")
    solution = None if args.solution is None else Path(args.solution)
    try:
        if args.all:
            reports = grade.progress(".", timeout=args.timeout, memory=memory, isolate=args.isolate)
            print(json.dumps([json.loads(r.to_json()) for r in reports], indent=2, ensure_ascii=False)
                  if args.json else grade.progress_table(reports))
            return 0 if all(r.all_passed for r in reports) else 1
        report = grade.grade(Path(args.notebook), timeout=args.timeout, solution=solution, memory=memory,
                             isolate=args.isolate)
    except sandbox.SandboxUnavailable as e:
        raise ValueError(str(e)) from None
    if args.report:  # written only now: every process the notebook started is gone
        files.write_atomically(Path(args.report), report.to_json() + "\n")
    print(report.to_json() if args.json else report.table())
    return 0 if report.all_passed else 1


def _site(args) -> int:
    from llmlab import site  # imported on use: `llmlab --help` stays fast

    notebooks = args.notebooks or sorted(Path("chapters").glob("[0-9]*.ipynb"))
    if not notebooks:
        raise FileNotFoundError("no chapters/NN_*.ipynb here: run from the project root or name the notebooks")
    failed = [p for p in site.build(notebooks, args.out, timeout=args.timeout) if p.problem]
    print(f"wrote {Path(args.out) / 'index.html'}")
    for p in failed:
        print(f"{p.notebook}: {p.problem}", file=sys.stderr)
    return 1 if failed else 0


def _bench(args) -> int:
    from llmlab.bench import run  # imported on use: `llmlab --help` stays fast

    return run(args.name, json_path=args.json)


def _results(args) -> int:
    from llmlab.bench import sync_readme  # imported on use: `llmlab --help` stays fast

    if args.check:
        if sync_readme(args.readme, args.records, check=True):
            print(f"{args.readme}'s results tables match {args.records}/")
            return 0
        print(f"{args.readme}'s results tables differ from {args.records}/: run `llmlab results`", file=sys.stderr)
        return 1
    sync_readme(args.readme, args.records)
    print(f"wrote the results tables of {args.readme} from {args.records}/")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmlab", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("doctor", help="check that this machine runs every chapter").set_defaults(func=_doctor)

    ex = sub.add_parser("exercises", help="generate or check exercises/ from solutions/")
    ex.add_argument("action", choices=["build", "check"])
    ex.add_argument("--root", default=".", help="project root holding solutions/ and exercises/")
    ex.add_argument("--force", action="store_true", help="build: replace exercise notebooks edited since built")
    ex.set_defaults(func=_exercises)

    gr = sub.add_parser("grade", help="execute a learner's notebook and report each exercise")
    gr.add_argument("notebook", nargs="?", help="a notebook, or a chapter's name (04_communication)")
    gr.add_argument("--all", action="store_true",
                    help="every chapter's exercise notebook: passed / total per chapter (untouched ones not run)")
    gr.add_argument("--json", action="store_true", help="machine-readable report")
    gr.add_argument("--report", default=None, help="also write the JSON report to this path (atomically)")
    gr.add_argument("--timeout", type=float, default=600, help="seconds for the whole notebook")
    gr.add_argument("--solution", default=None, help="the chapter's solution notebook (default: solutions/NAME)")
    gr.add_argument("--memory", type=float, default=None,
                    help="GiB each process of the notebook may allocate (default: this machine's memory)")
    gr.add_argument("--isolate", action="store_true",
                    help="run in a bubblewrap sandbox: no network, file systems read-only, scratch home")
    gr.set_defaults(func=_grade)

    be = sub.add_parser("bench", help="benchmark an implementation against its peer")
    be.add_argument("name")
    be.add_argument("--json", default=None, help="also write the JSON record to this path")
    be.set_defaults(func=_bench)

    re_ = sub.add_parser("results", help="write README's results tables from the recorded bench runs")
    re_.add_argument("--check", action="store_true", help="only check that README matches the records")
    re_.add_argument("--readme", default="README.md")
    re_.add_argument("--records", default="results", help="folder of bench JSON records")
    re_.set_defaults(func=_results)

    si = sub.add_parser("site", help="execute the chapters and write HTML pages with their outputs")
    si.add_argument("notebooks", nargs="*", help="default: chapters/NN_*.ipynb")
    si.add_argument("--out", default="site", help="folder for the pages and index.html")
    si.add_argument("--timeout", type=float, default=600, help="seconds for each chapter")
    si.set_defaults(func=_site)

    sub.add_parser("train", add_help=False, help="the capstone training run (flags: `llmlab train --help`)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:  # its flags are the capstone's own parser's
        from llmlab.train.capstone import main as train  # imported on use: `llmlab --help` stays fast

        return train(argv[1:], prog="llmlab train")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"llmlab {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
