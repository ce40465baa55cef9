"""The self-study pages: every chapter executed on this machine and written as HTML with its outputs.

A reader who cannot run the notebooks (no time, a phone, a library computer) still sees every table, plot and
widget result, measured on the machine that built the pages, which each page names. Each chapter runs as
`llmlab grade` runs a notebook (`llmlab.exercises.grade.execute`: a fresh kernel of this Python, the chapter's
folder as working directory, one timeout for the whole chapter, errors recorded rather than stopping the run);
nbconvert's HTML exporter (the JupyterLab look) writes the page. Widgets show the static result they carry (a
text line and a PNG of the plot) since a page has no kernel behind its sliders.

The command prints a line per chapter: its page, time, the machine's load and "ok" or what failed, flagged when
the chapter ran over its budget on a 2-core CPU (`BUDGET_S`; flagged, not failed: a shared machine's wall time
varies). Each chapter's line in the index gives its time and the machine's load while it ran (`timing.Load`: the
1-minute load average, the busier of the readings before and after the chapter, and the cores), so a reader can
tell a figure measured on a quiet machine from one measured beside other work; the chapter's own kernel counts in it.

Progress bars are off in a page: a page cannot hold a live bar, and a tqdm bar in a notebook is a widget whose
saved text is its first frame ("0%|          | 0/3"). The kernel runs with TQDM_DISABLE=1, which turns off the
bars of `tqdm.std` (the Trainer's in a script, a rank's); `tqdm.notebook`'s bar (what `tqdm.auto` gives in a
kernel) ignores that variable, so its output — a widget view whose text is a bar — is dropped from the page.
`frozen_bars` finds any bar a page still shows stopped short of its total (tools/busy_check.py fails on one).

    llmlab site                                         # chapters/*.ipynb → site/NN_topic.html, site/index.html
    llmlab site chapters/04_communication.ipynb --out /tmp/pages --timeout 300
    make site

Pages are written to a temporary file and renamed, so an interrupted build never leaves half a page over an
earlier good one. A chapter whose cell raised, or that ran out of time, still gets its page (the error shows where
it happened) and is listed in the index as failed; the command then exits with status 1, naming them.
"""

from __future__ import annotations

import html
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from nbconvert import HTMLExporter

from llmlab import files, runtime, timing
from llmlab.exercises.grade import cell_errors, execute
from llmlab.exercises.notebooks import read_notebook, title

__all__ = ["KERNEL_ENV", "BUDGET_S", "Page", "build_page", "build", "write_index", "frozen_bars"]

# tqdm's bar: "desc:  40%|████      | 2/5 [00:01<00:01,  1.9it/s]" (percentage, bar, count/total)
_BAR = re.compile(r"(\d{1,3})%\|[^|\n]*\|\s*(\d+)/(\d+)\b")
_WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
KERNEL_ENV = {"TQDM_DISABLE": "1"}  # added to a chapter's kernel environment: tqdm.std's bars off
BUDGET_S = 60.0  # a chapter's wall-time budget on a 2-core CPU (README, "Tests"; conftest.py's for pytest)


@dataclass(frozen=True)
class Page:
    """One chapter's page: where it was written, its title, how long the chapter ran, and what went wrong."""

    notebook: Path
    html: Path
    title: str
    seconds: float
    load: timing.Load  # the busier of the machine's loads before and after the chapter ran
    problem: str = ""  # the first cell error, or why the run stopped; empty when every cell ran cleanly


def _problem(nb, stop) -> str:
    first = next(cell_errors(nb), None)
    if first is not None:
        index, name, message = first
        return f"cell {index + 1}: {name}: {message}"
    return stop.reason if stop is not None else ""


def frozen_bars(text: str) -> list[str]:
    """The progress bars in `text` (a page's text or a cell's output) that stopped short of their total."""
    return [m[0] for m in _BAR.finditer(text) if int(m[2]) < int(m[3])]


def _drop_progress_widgets(nb) -> None:
    """Remove every output that is a widget view whose text is a progress bar (see the module's docstring)."""
    for cell in nb.cells:
        if "outputs" in cell:
            cell.outputs = [o for o in cell.outputs
                            if not (_WIDGET_VIEW in o.get("data", {}) and _BAR.search(o["data"].get("text/plain", "")))]


def build_page(notebook: str | os.PathLike, out: str | os.PathLike, timeout: float = 600) -> Page:
    """Execute `notebook` (at most `timeout` seconds) and write `out`/<its name>.html; return its `Page`."""

    notebook = Path(notebook)
    if notebook.suffix != ".ipynb" or not notebook.is_file():
        raise ValueError(f"notebook={str(notebook)!r} is not a .ipynb file")
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
    nb = read_notebook(notebook)
    load, started = timing.Load.now(), time.monotonic()
    stop = execute(nb, notebook.resolve().parent, timeout, env=KERNEL_ENV)
    seconds, load = time.monotonic() - started, load.busier(timing.Load.now())
    _drop_progress_widgets(nb)
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    page = Page(notebook, Path(out) / f"{notebook.stem}.html", title(nb, notebook.stem), seconds, load,
                _problem(nb, stop))
    files.write_atomically(page.html, body)
    return page


def write_index(pages: list[Page], out: str | os.PathLike, machine: str) -> Path:
    """Write `out`/index.html: one line per chapter (title, link, time, load, any problem) and the machine's name."""
    rows = "\n".join(
        f'<li><a href="{html.escape(p.html.name)}">{html.escape(p.title)}</a> — ran in {p.seconds:.0f} s'
        f' at {html.escape(str(p.load))}'
        + (f' <strong class="failed">failed: {html.escape(p.problem)}</strong>' if p.problem else "") + "</li>"
        for p in pages)
    text = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>llmlab: the chapters, executed</title>
<style>body {{ font-family: sans-serif; max-width: 50em; margin: 2em auto; }} .failed {{ color: #b00; }}</style>
</head><body>
<h1>llmlab: the chapters, executed</h1>
<p>Every page below was run top to bottom on: <code>{html.escape(machine)}</code>, on {time.strftime("%Y-%m-%d")}.
Numbers measured here (times, bandwidths, FLOP/s) are this machine's; run the notebooks to see yours.
Each line gives the machine's load while the chapter ran (the 1-minute load average, the busier of the readings
before and after it, the chapter's own work included) on its cores: a load above the cores means other work
shared them, and a timed figure whose rounds then spread too wide says so beside it.</p>
<ol>
{rows}
</ol></body></html>
"""
    path = Path(out) / "index.html"
    files.write_atomically(path, text)
    return path


def build(notebooks: list[str | os.PathLike], out: str | os.PathLike = "site", timeout: float = 600,
          log=print) -> list[Page]:
    """Build the page of every notebook, in order, and the index; `log` gets one line per chapter."""

    if not notebooks:
        raise ValueError("notebooks is empty: give chapter notebooks (e.g. chapters/*.ipynb)")
    pages = []
    for notebook in notebooks:
        page = build_page(notebook, out, timeout)
        over = f", over the {BUDGET_S:g} s budget" if page.seconds > BUDGET_S else ""
        log(f"{page.html}  {page.seconds:5.1f} s  {page.load}  {'FAILED ' + page.problem if page.problem else 'ok'}"
            f"{over}")
        pages.append(page)
    write_index(pages, out, runtime.describe())
    return pages
