"""START.md, the page `make lab` opens first: every chapter and its exercises, linked.

    .venv/bin/python tools/landing.py           # rewrite START.md from chapters/ and exercises/
    .venv/bin/python tools/landing.py --check   # exit 1, saying so, when START.md is stale or missing

Titles and links come from the notebooks themselves: a chapter's first "# " heading (as `llmlab site` titles its
pages) and an exercise notebook's "Exercise N.M" headings (as `llmlab grade` finds them), one row per NN_topic
name in chapters/ or exercises/. tests/test_lab.py fails when START.md is stale and checks that every link
resolves, so the page cannot drift from the files.

A Markdown file rather than a notebook: it needs no kernel, and opening it cannot change it (a notebook gets its
kernel's metadata written in). `make lab`'s server opens Markdown rendered, with live links (a click opens the
chapter in a new tab), by its default settings in tools/lab-settings/overrides.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from urllib.parse import quote

from llmlab.exercises.notebooks import cell_exercises, read_notebook, title

ROOT = Path(__file__).resolve().parents[1]
LANDING = "START.md"  # relative to the root: the page tools/lab.py opens (its LANDING)
FOLDERS = ("chapters", "exercises")

INTRO = """\
# llmlab — start here

> **Generated from `chapters/` and `exercises/` by `tools/landing.py`** — do not edit; run
> `.venv/bin/python tools/landing.py` again after adding a notebook.

The chapters below show how large models are trained, each with a notebook of exercises. Open a chapter, read it and
run it top to bottom (**Run ▸ Run All Cells**); then open its exercises. In an exercise notebook each
`raise NotImplementedError(...)` marks code for you to write, and the check cell below it tests your answer on
fresh random inputs: ✅ passed, ⏳ not attempted yet, or ❌ failed with what differs and a hint. Save your work
with **File ▸ Save** (Ctrl+S); to grade a whole notebook, open a terminal (**File ▸ New ▸ Terminal**) and run
`llmlab grade exercises/01_compute.ipynb`; `llmlab grade --all` shows your progress in every chapter (exercises
passed of each chapter's total).

The file browser on the left shows the whole project: `chapters/`, `exercises/`, and `solutions/` with the answers
(try first).
"""


def _md(text: str) -> str:
    """`text` safe inside a Markdown table cell and a link's text."""
    for char in "\\|[]":
        text = text.replace(char, "\\" + char)
    return text


def _link(text: str, path: str) -> str:
    return f"[{_md(text)}]({quote(path)})"


def _row(root: Path, name: str) -> str:
    chapter, exercises = (root / folder / name for folder in FOLDERS)
    cells = []
    if chapter.exists():
        cells.append(_link(title(read_notebook(chapter), chapter.stem), f"chapters/{name}"))
    else:
        cells.append("—")
    if exercises.exists():
        found = dict.fromkeys(e for e in cell_exercises(read_notebook(exercises)) if e is not None)
        listed = " · ".join(_md(f"{e.id} {e.title}".strip()) for e in found)
        count = f"{len(found)} exercise{'s' * (len(found) != 1)}"
        cells.append(_link(count, f"exercises/{name}") + (f": {listed}" if listed else ""))
    else:
        cells.append("—")
    return f"| {' | '.join(cells)} |"


def text(root: Path = ROOT) -> str:
    """The exact text of START.md for the notebooks under `root` (ending in a newline)."""
    names = sorted({p.name for folder in FOLDERS for p in (root / folder).glob("*.ipynb")})
    if not names:
        raise FileNotFoundError(f"root={root}: no notebooks in {' or '.join(f'{f}/' for f in FOLDERS)}")
    table = "\n".join(["| chapter | exercises |", "|---|---|", *(_row(root, name) for name in names)])
    return INTRO + "\n" + table + "\n"


def is_current(path: Path, root: Path = ROOT) -> bool:
    """True when the file at `path` is what :func:`text` would write for `root`."""
    return path.is_file() and path.read_text(encoding="utf-8") == text(root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/landing.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when START.md is stale, writing nothing")
    args = parser.parse_args(argv)
    path = ROOT / LANDING
    if args.check:
        if not is_current(path):
            print(f"{path}: stale or missing; run .venv/bin/python tools/landing.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(text(ROOT), encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
