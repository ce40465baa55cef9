"""Write exercises/ from solutions/, and tell when exercises/ is out of date.

Every exercise has one source: ``solutions/NN_topic.ipynb``. ``llmlab exercises build`` (:func:`build`)
writes ``exercises/NN_topic.ipynb`` from it; ``llmlab exercises check`` (:func:`check`) fails when that
output is missing, stale or edited by hand. The rules a solution notebook follows:

Exercises
    An exercise starts at a markdown cell with a heading line ``Exercise N.M`` and an optional title, at any
    heading level, e.g. ``### Exercise 4.1: Ring reduce-scatter`` (the separator after the id may be ``:``,
    ``.`` or a dash). The exercise owns the cells from its heading up to the next exercise heading, so
    its solution code and its check cell (``check.ring_reduce_scatter(ring_reduce_scatter)``) follow the
    heading. Ids are unique within a notebook, and the grader (``llmlab grade``) reports one row per heading.

Solution regions (the nbgrader convention)
    Inside a code cell, the lines from ``### BEGIN SOLUTION`` to ``### END SOLUTION`` (both included) are the
    answer. The exercise notebook replaces them with one line, at the indentation of the BEGIN line::

        raise NotImplementedError("Exercise 4.1: Ring reduce-scatter")

    A region lies within one code cell, does not nest, belongs to the nearest exercise heading above it, and
    sits inside a function body (it is indented), so that the exercise notebook still runs top to bottom and
    the check reports "not attempted yet". Every exercise has at least one region. A line that looks like a
    marker but is not exactly one of the two (``## END SOLUTION``, ``# begin solution``), or a marker line in
    a markdown cell, is an error rather than text silently left in: an answer must never leak into exercises/.

Starter code (for exercises that hand the learner code to fix, e.g. a training script with planted bugs)
    A region may hold one starter block, from ``### BEGIN STARTER`` to ``### END STARTER``, at the indentation
    of the region's BEGIN line. Every line between them is commented out at that indentation (``# `` then
    the code, or a lone ``#`` for an empty line; this is what an editor's toggle-comment writes), so the
    solution notebook runs its answer and shows the starter as a comment. The exercise notebook gets, in
    place of the region, the raise line followed by the starter uncommented::

        raise NotImplementedError("Exercise 7.1: Find the bugs")  # delete this line, then fix the code below
        optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
        ...

    so the exercise still runs top to bottom and reads "not attempted yet" until the learner deletes the raise;
    the answer lines of the region are left out as before. A starter marker outside a region, a second or
    unclosed starter, one at another indentation, or a line in it that is not commented out is an error.

The generated notebook
    It starts with a markdown cell saying it is generated from ``solutions/NN_topic.ipynb`` and is not to be
    edited. Outputs, execution counts and timing metadata are stripped, cell ids are positional
    (``cell-0``, ``cell-1``, ...), and it is written by nbformat (sorted keys) with a trailing newline, so the
    same solution always gives the same bytes. Its metadata records ``llmlab.generated_from`` and
    ``llmlab.sha256``, a fingerprint of everything else in the file: that is how :func:`check` tells a
    *hand-edited* exercise (the fingerprint no longer matches the file) from a *stale* one (an untouched
    file built from an older solution).

Problems are reported with the file and the cell (1-based, with its first line), e.g.
``solutions/04_communication.ipynb, cell 7 ("def ring_reduce_scatter(x):"), line 3: ...``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbformat import reader

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
BEGIN_STARTER, END_STARTER = "### BEGIN STARTER", "### END STARTER"
_MARKERS = (BEGIN, END, BEGIN_STARTER, END_STARTER)
_LOOKS_LIKE_MARKER = re.compile(r"#+\s*(BEGIN|END)\s+(SOLUTION|STARTER)\b", re.IGNORECASE)
_FIX_STARTER = "  # delete this line, then fix the code below"
_TITLE = re.compile(r"^#\s+(.+?)\s*$", re.M)
_HEADING = re.compile(r"^#{1,6}\s+Exercise\s+(\d+(?:\.\d+)+)\b[\s:.—–-]*(.*?)\s*$", re.MULTILINE)


class NotebookError(ValueError):
    """A notebook that cannot be read, or a solution notebook that breaks the rules above."""


@dataclass(frozen=True)
class Exercise:
    """One exercise heading: its id ("4.1"), title, and the index of its markdown cell."""

    id: str
    title: str
    cell: int

    @property
    def label(self) -> str:
        return f"Exercise {self.id}: {self.title}" if self.title else f"Exercise {self.id}"


def read_notebook(path: Path) -> nbformat.NotebookNode:
    """Read a Jupyter (nbformat 4) notebook, or raise NotebookError saying why `path` is not one."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such notebook")
    if not path.is_file():
        raise NotebookError(f"{path}: not a notebook: it is a directory")
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text)
    except UnicodeDecodeError:
        raise NotebookError(f"{path}: not a notebook: the file is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise NotebookError(
            f"{path}: not a notebook: invalid JSON at line {e.lineno}, column {e.colno} ({e.msg})"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("cells"), list):
        raise NotebookError(f"{path}: not a notebook: the JSON has no 'cells' list")
    if data.get("nbformat") != 4:
        raise NotebookError(f"{path}: nbformat {data.get('nbformat')!r} notebook; llmlab reads nbformat 4")
    try:
        nb = reader.reads(text)
        nbformat.validate(nb)
    except nbformat.ValidationError as e:
        raise NotebookError(f"{path}: not a valid notebook: {_shorten(e.message, 200)}") from None
    return nb


def title(nb: nbformat.NotebookNode, fallback: str) -> str:
    """The notebook's title: its first level-1 Markdown heading ("# ..."), or `fallback` when it has none."""
    for cell in nb.cells:
        if cell.cell_type == "markdown" and (m := _TITLE.search(cell.source)):
            return m[1]
    return fallback


def cell_exercises(nb: nbformat.NotebookNode) -> list[Exercise | None]:
    """For each cell, the exercise it belongs to: the nearest exercise heading at or above it (or None)."""
    owners, current = [], None
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            headings = _HEADING.findall(cell.source)
            if headings:
                exercise_id, title = headings[-1]
                current = Exercise(exercise_id, title, index)
        owners.append(current)
    return owners


def reference_lines(nb: nbformat.NotebookNode) -> dict[str, int]:
    """Exercise id → the lines of code its reference solution writes: those inside its solution regions that are
    neither blank nor a comment, its starter block left out (issue 28's measure of how much a learner builds)."""
    counts: dict[str, int] = {}
    for cell, owner in zip(nb.cells, cell_exercises(nb), strict=True):
        if cell.cell_type != "code" or owner is None:
            continue
        inside = False
        for line in cell.source.splitlines():
            text = line.strip()
            if text in (BEGIN, END_STARTER):
                inside = True
            elif text in (END, BEGIN_STARTER):
                inside = False
            elif inside and text and not text.startswith("#"):
                counts[owner.id] = counts.get(owner.id, 0) + 1
    return counts


def exercise_text(solution: Path) -> str:
    """The exact text :func:`build` writes for `solution` (a solutions/NN_topic.ipynb path)."""
    solution = Path(solution)
    nb = read_notebook(solution)
    owners = cell_exercises(nb)
    regions = {}  # exercise -> number of solution regions it has
    for index, owner in enumerate(owners):
        if owner is not None and owner.cell == index:
            _check_unique(solution, nb, owner, regions)
            regions[owner] = 0
    cells, starters = [], 0
    for index, (cell, owner) in enumerate(zip(nb.cells, owners, strict=True)):
        cell = copy.deepcopy(cell)
        if cell.cell_type == "code":
            cell.source, count, with_starter = _replace_regions(cell.source, owner, _where(solution, nb, index))
            starters += with_starter
            if owner is not None:
                regions[owner] += count
            cell.outputs, cell.execution_count = [], None
        elif any(_LOOKS_LIKE_MARKER.match(line.strip()) for line in cell.source.split("\n")):
            raise NotebookError(
                f"{_where(solution, nb, index)}: a solution marker in a {cell.cell_type} cell; regions work "
                f"only in code cells, and this text would appear in the exercise as it is"
            )
        cell.metadata.pop("execution", None)
        cells.append(cell)
    if not regions:
        raise NotebookError(
            f"{solution}: no exercise: add a markdown heading like `### Exercise 1.1: Title` and a "
            f"{BEGIN} ... {END} region in a code cell after it"
        )
    for exercise, count in regions.items():
        if count == 0:
            raise NotebookError(
                f"{_where(solution, nb, exercise.cell)}: {exercise.label} has no {BEGIN} region, "
                f"so its exercise notebook would contain the answer"
            )
    cells.insert(0, nbformat.v4.new_markdown_cell(_header(solution.name, starters > 0)))
    for number, cell in enumerate(cells):
        cell.id = f"cell-{number}"
    metadata = copy.deepcopy(nb.metadata)
    metadata["llmlab"] = {"generated_from": f"solutions/{solution.name}"}
    generated = nbformat.v4.new_notebook(cells=cells, metadata=metadata)
    generated.metadata.llmlab.sha256 = _fingerprint(generated)
    return nbformat.writes(generated) + "\n"


def build(root: Path, force: bool = False) -> list[Path]:
    """Write exercises/NN_topic.ipynb for every solutions/NN_topic.ipynb under `root`; return the paths.

    Every solution is converted before anything is written, so a bad solution leaves exercises/ as it was. An
    exercise notebook edited since it was built (its fingerprint no longer matches: a learner's work, saved by
    JupyterLab) is not overwritten: NotebookError names every such file, and nothing is written, unless `force`.
    """
    root = Path(root)
    texts = {root / "exercises" / path.name: exercise_text(path) for path in _solutions(root)}
    edited = [path for path, text in texts.items() if path.is_file() and path.read_bytes() != text.encode("utf-8")
              and _why_different(path, path.name).startswith("hand-edited")]
    if edited and not force:
        raise NotebookError(f"{', '.join(map(str, edited))}: edited since it was built (a learner's work?); not "
                            "overwritten: move it away first, or pass --force to replace it")
    (root / "exercises").mkdir(exist_ok=True)
    for path, text in texts.items():
        path.write_bytes(text.encode("utf-8"))
    return list(texts)


def check(root: Path) -> list[str]:
    """Compare exercises/ with what :func:`build` would write now; return the problems (empty: up to date)."""
    root = Path(root)
    expected = {path.name: exercise_text(path) for path in _solutions(root)}
    folder = root / "exercises"
    problems = []
    for name, text in expected.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{path}: missing (build writes it from solutions/{name})")
        elif path.read_bytes() != text.encode("utf-8"):
            problems.append(f"{path}: {_why_different(path, name)}")
    for path in sorted(folder.glob("*.ipynb")):
        if path.name not in expected:
            problems.append(
                f"{path}: no solution (solutions/{path.name} does not exist): "
                f"delete it or restore the solution"
            )
    return problems


def _solutions(root: Path) -> list[Path]:
    folder = root / "solutions"
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no solutions/ directory (expected solutions/NN_topic.ipynb)")
    return sorted(folder.glob("*.ipynb"))


def _replace_regions(source: str, owner: Exercise | None, where: str) -> tuple[str, int, int]:
    """Replace each BEGIN ... END region in one cell's source (by its raise line, then its starter uncommented,
    if it has one); return the new source, the number of regions and how many of them had a starter."""
    kept, count, starters = [], 0, 0
    opened = None  # (line number, indentation) of the open BEGIN line
    starter = None  # the open region's starter: its BEGIN STARTER line number and uncommented lines
    for number, line in enumerate(source.split("\n"), start=1):
        marker = line.strip()
        at = f"{where}, line {number}"
        if marker not in _MARKERS:
            if _LOOKS_LIKE_MARKER.search(marker):
                raise NotebookError(
                    f"{at}: {marker!r} looks like a solution marker; write exactly one of "
                    f"{', '.join(map(repr, _MARKERS))} on a line of its own"
                )
            if opened is None:
                kept.append(line)
            elif starter is not None and starter["open"]:
                starter["lines"].append(_uncomment(line, opened[1], at))
        elif marker in (BEGIN_STARTER, END_STARTER):
            starter = _starter_marker(marker, line, opened, starter, number, at)
        elif marker == BEGIN:
            if opened is not None:
                raise NotebookError(f"{at}: nested {BEGIN} (a region is already open since line {opened[0]})")
            if owner is None:
                raise NotebookError(
                    f"{at}: solution region outside any exercise: no markdown heading like "
                    f"`### Exercise 1.1: Title` comes before this cell"
                )
            indent = line[: len(line) - len(line.lstrip())]
            if not indent:
                raise NotebookError(
                    f"{at}: solution region at the top level of the cell; the exercise notebook would stop "
                    f"here. Put the answer inside a function body, which the check calls"
                )
            opened = (number, indent)
        elif opened is None:
            raise NotebookError(f"{at}: {END} without a {BEGIN} before it")
        else:
            if starter is not None and starter["open"]:
                raise NotebookError(
                    f"{at}: {END} while the {BEGIN_STARTER} of line {starter['line']} is still open; "
                    f"close it with {END_STARTER} first"
                )
            message = json.dumps(owner.label, ensure_ascii=False)  # a valid Python string literal
            raise_line = f"{opened[1]}raise NotImplementedError({message})"
            if starter is None:
                kept.append(raise_line)
            else:
                kept += [raise_line + _FIX_STARTER, *starter["lines"]]
                starters += 1
            count, opened, starter = count + 1, None, None
    if opened is not None:
        raise NotebookError(f"{where}, line {opened[0]}: {BEGIN} is never closed by {END} in this cell")
    return "\n".join(kept), count, starters


def _starter_marker(marker: str, line: str, opened, starter: dict | None, number: int, at: str) -> dict:
    """The open region's starter after a BEGIN/END STARTER line, or a NotebookError saying why it is misplaced."""
    if opened is None:
        raise NotebookError(f"{at}: {marker} outside a solution region; a starter belongs inside {BEGIN} ... {END}")
    if line[: len(line) - len(line.lstrip())] != opened[1]:
        raise NotebookError(
            f"{at}: {marker} must be at the indentation of the {BEGIN} of line {opened[0]} "
            f"({len(opened[1])} spaces)"
        )
    if marker == BEGIN_STARTER:
        if starter is not None:
            raise NotebookError(
                f"{at}: a second {BEGIN_STARTER} in the region of line {opened[0]} (its starter began on line "
                f"{starter['line']}); a region has at most one starter"
            )
        return {"line": number, "lines": [], "open": True}
    if starter is None or not starter["open"]:
        raise NotebookError(f"{at}: {END_STARTER} without a {BEGIN_STARTER} before it")
    return {**starter, "open": False}


def _uncomment(line: str, indent: str, at: str) -> str:
    """A starter line without its comment: `indent + "# " + code` gives `indent + code`, a lone "#" an empty line."""
    if not line.strip() or line.rstrip() == indent + "#":
        return ""
    if not line.startswith(indent + "# "):
        raise NotebookError(
            f"{at}: {line.strip()!r} inside a starter block is not commented out; every starter line is "
            f"'# ' + code at the indentation of {BEGIN_STARTER} ({len(indent)} spaces), or a lone '#'"
        )
    return indent + line[len(indent) + 2:]


def _check_unique(path: Path, nb, exercise: Exercise, seen: dict[Exercise, int]) -> None:
    for other in seen:
        if other.id == exercise.id:
            raise NotebookError(
                f"{_where(path, nb, exercise.cell)}: Exercise {exercise.id} is already the heading of cell "
                f"{other.cell + 1}; exercise ids must be unique"
            )


def _header(name: str, starters: bool) -> str:
    fix = (" Where code follows the `raise`, that code is yours to fix: delete the `raise` line and edit it."
           if starters else "")
    return (
        f"> **Type your answers into this file.** Each `raise NotImplementedError(...)` marks code for you to "
        f"write; the check cell after it tests your answer.{fix} JupyterLab saves your work here, and "
        f"`llmlab exercises build` never overwrites a notebook you have edited (`--force` replaces it).\n"
        f">\n"
        f"> Grade the whole notebook from JupyterLab's terminal (it opens in the project root): "
        f"`llmlab grade exercises/{name}` (in a shell of your own: `.venv/bin/llmlab grade exercises/{name}`).\n"
        f">\n"
        f"> *Course authors: this notebook is generated from `solutions/{name}` by `llmlab exercises build`; "
        f"change the solution, not this file.*"
    )


def _why_different(path: Path, name: str) -> str:
    """Tell an untouched file built from an older solution (stale) from one edited by hand."""
    try:
        nb = read_notebook(path)
    except NotebookError as e:
        return f"hand-edited: it is no longer a valid notebook ({e})"
    if not untouched(nb):
        return (
            f"hand-edited: it differs from what `llmlab exercises build` wrote; "
            f"make the change in solutions/{name} instead"
        )
    return f"stale: solutions/{name} changed since exercises/ was built"


def untouched(nb: nbformat.NotebookNode) -> bool:
    """True when the exercise notebook `nb` is as `llmlab exercises build` wrote it (its fingerprint matches)."""
    return nb.metadata.get("llmlab", {}).get("sha256") == _fingerprint(nb)


def _fingerprint(nb: nbformat.NotebookNode) -> str:
    """sha256 of the notebook as nbformat writes it, leaving out the recorded fingerprint itself."""
    nb = copy.deepcopy(nb)
    nb.metadata.get("llmlab", {}).pop("sha256", None)
    return hashlib.sha256(nbformat.writes(nb).encode("utf-8")).hexdigest()


def _where(path: Path, nb, index: int) -> str:
    first_line = next((line.strip() for line in nb.cells[index].source.split("\n") if line.strip()), "")
    return f"{path}, cell {index + 1} ({json.dumps(_shorten(first_line, 40), ensure_ascii=False)})"


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
