"""The self-study pages: every chapter executed on this machine and written as HTML with its outputs.

A reader who cannot run the notebooks (no time, a phone, a library computer) still sees every table, plot and
widget result, measured on the machine that built the pages, which each page names. Each chapter runs as
`llmlab grade` runs a notebook (`llmlab.exercises.grade.execute`: a fresh kernel of this Python, the chapter's
folder as working directory, one timeout for the whole chapter, errors recorded rather than stopping the run);
nbconvert's HTML exporter (the JupyterLab look) writes the page. Widgets show the static result they carry (a
text line and a PNG of the plot) since a page has no kernel behind its sliders.

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
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from nbconvert import HTMLExporter

from llmlab import runtime
from llmlab.exercises.grade import cell_errors, execute
from llmlab.exercises.notebooks import read_notebook

__all__ = ["Page", "build_page", "build", "write_index"]

_TITLE = re.compile(r"^#\s+(.+?)\s*$", re.M)


@dataclass(frozen=True)
class Page:
    """One chapter's page: where it was written, its title, how long the chapter ran, and what went wrong."""

    notebook: Path
    html: Path
    title: str
    seconds: float
    problem: str = ""  # the first cell error, or why the run stopped; empty when every cell ran cleanly


def _title(nb, fallback: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown" and (m := _TITLE.search(cell.source)):
            return m[1]
    return fallback


def _problem(nb, stop) -> str:
    first = next(cell_errors(nb), None)
    if first is not None:
        index, name, message = first
        return f"cell {index + 1}: {name}: {message}"
    return stop.reason if stop is not None else ""


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the page from a web server
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def build_page(notebook: str | os.PathLike, out: str | os.PathLike, timeout: float = 600) -> Page:
    """Execute `notebook` (at most `timeout` seconds) and write `out`/<its name>.html; return its `Page`."""

    notebook = Path(notebook)
    if notebook.suffix != ".ipynb" or not notebook.is_file():
        raise ValueError(f"notebook={str(notebook)!r} is not a .ipynb file")
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
    nb = read_notebook(notebook)
    started = time.monotonic()
    stop = execute(nb, notebook.resolve().parent, timeout)
    seconds = time.monotonic() - started
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    page = Page(notebook, Path(out) / f"{notebook.stem}.html", _title(nb, notebook.stem), seconds, _problem(nb, stop))
    _write_atomically(page.html, body)
    return page


def write_index(pages: list[Page], out: str | os.PathLike, machine: str) -> Path:
    """Write `out`/index.html: one line per chapter (title, link, time, any problem) and the machine's name."""
    rows = "\n".join(
        f'<li><a href="{html.escape(p.html.name)}">{html.escape(p.title)}</a> — ran in {p.seconds:.0f} s'
        + (f' <strong class="failed">failed: {html.escape(p.problem)}</strong>' if p.problem else "") + "</li>"
        for p in pages)
    text = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>llmlab: the chapters, executed</title>
<style>body {{ font-family: sans-serif; max-width: 50em; margin: 2em auto; }} .failed {{ color: #b00; }}</style>
</head><body>
<h1>llmlab: the chapters, executed</h1>
<p>Every page below was run top to bottom on: <code>{html.escape(machine)}</code>, on {time.strftime("%Y-%m-%d")}.
Numbers measured here (times, bandwidths, FLOP/s) are this machine's; run the notebooks to see yours.</p>
<ol>
{rows}
</ol></body></html>
"""
    path = Path(out) / "index.html"
    _write_atomically(path, text)
    return path


def build(notebooks: list[str | os.PathLike], out: str | os.PathLike = "site", timeout: float = 600,
          log=print) -> list[Page]:
    """Build the page of every notebook, in order, and the index; `log` gets one line per chapter."""

    if not notebooks:
        raise ValueError("notebooks is empty: give chapter notebooks (e.g. chapters/*.ipynb)")
    pages = []
    for notebook in notebooks:
        page = build_page(notebook, out, timeout)
        log(f"{page.html}  {page.seconds:5.1f} s  {'FAILED ' + page.problem if page.problem else 'ok'}")
        pages.append(page)
    write_index(pages, out, runtime.describe())
    return pages
