"""Grade a learner's notebook: run it, collect what each check reported, give one row per exercise.

:func:`grade` executes a copy of the notebook with nbclient (kernel ``python3`` of the interpreter
running the grader, working directory = the notebook's folder; the file itself is not modified). Errors do
not stop the run (``allow_errors``), so a broken exercise does not hide the ones after it, but one timeout
bounds the whole run, kernel start included: when it expires the run stops and the exercises not yet checked
say so.

Each check (:mod:`llmlab.checks`) leaves a machine-readable ``application/vnd.llmlab.check+json``
record in its cell's outputs; the grader reads those, not the printed text. The exercises are the headings
``### Exercise N.M: Title`` (found as in :mod:`llmlab.exercises.notebooks`), and each gets one status:

- ``passed``, ``not attempted`` or ``failed``: what its check reported (if it ran several checks, the worst);
- ``error``: no check reported, and the detail says why: an exception in the exercise's own cells (e.g. a
  ``NameError`` from a renamed function), the run stopping early, or an earlier cell failing.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ipykernel.kernelspec import RESOURCES, get_kernel_dict
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError

from llmlab.checks import FAILED, MIME_TYPE, NOT_ATTEMPTED, PASSED
from llmlab.exercises.notebooks import cell_exercises, read_notebook

ERROR = "error"
_ICONS = {PASSED: "✅", NOT_ATTEMPTED: "⏳", FAILED: "❌", ERROR: "❗"}
_WORST_FIRST = (FAILED, NOT_ATTEMPTED, PASSED)


@dataclass(frozen=True)
class Row:
    """One exercise's outcome."""

    exercise: str
    title: str
    status: str
    detail: str = ""


@dataclass(frozen=True)
class Stop:
    """Why a run ended before its last cell: the cell it stopped at (0-based) and a readable reason."""

    cell: int
    reason: str
    timed_out: bool


@dataclass(frozen=True)
class Report:
    """The outcome of grading one notebook."""

    notebook: Path
    rows: tuple[Row, ...]
    seconds: float
    stop: Stop | None = None

    @property
    def all_passed(self) -> bool:
        """True when there is at least one exercise and every exercise passed."""
        return bool(self.rows) and all(row.status == PASSED for row in self.rows)

    @property
    def timed_out(self) -> bool:
        return self.stop is not None and self.stop.timed_out

    def table(self) -> str:
        """A text table: one line per exercise, its detail indented below it."""
        lines = [f"{self.notebook} (ran in {self.seconds:.1f} s)", ""]
        id_width = max((len(row.exercise) for row in self.rows), default=0)
        title_width = max((len(row.title) for row in self.rows), default=0)
        for row in self.rows:
            lines.append(
                f"  {_ICONS[row.status]} {row.exercise:<{id_width}}  {row.title:<{title_width}}  "
                f"{row.status}".rstrip()
            )
            if row.detail:
                lines.append(" " * (id_width + 7) + row.detail)
        if not self.rows:
            lines.append("  no exercises: no `### Exercise N.M: Title` heading in this notebook")
        if self.stop is not None:
            lines += ["", f"Stopped early: {self.stop.reason}"]
        passed = sum(row.status == PASSED for row in self.rows)
        lines += ["", f"{passed} of {len(self.rows)} exercises passed."]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {
                "notebook": str(self.notebook),
                "seconds": round(self.seconds, 2),
                "all_passed": self.all_passed,
                "passed": sum(row.status == PASSED for row in self.rows),
                "total": len(self.rows),
                "timed_out": self.timed_out,
                "stopped": self.stop.reason if self.stop else None,
                "exercises": [asdict(row) for row in self.rows],
            },
            indent=2,
            ensure_ascii=False,
        )


def grade(path: Path, timeout: float = 600) -> Report:
    """Execute the notebook at `path` within `timeout` seconds and report every exercise in it."""
    path = Path(path)
    if not timeout > 0:
        raise ValueError(f"timeout={timeout} must be a positive number of seconds")
    nb = read_notebook(path)
    started = time.monotonic()
    stop = execute(nb, path.resolve().parent, timeout)
    return Report(path, tuple(_rows(nb, stop)), time.monotonic() - started, stop)


def execute(nb, folder: Path, timeout: float, env: dict[str, str] | None = None) -> Stop | None:
    """Run every cell of `nb` in place (outputs land in `nb`); say where and why it stopped early, if so.

    Errors in cells do not stop the run; `timeout` bounds all of it, kernel start included. `env`: variables set
    in the kernel's environment on top of this process's (`llmlab site` turns progress bars off with it). Also
    what `llmlab site` runs each chapter with.
    """
    if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                               for k, v in env.items())):
        raise ValueError(f"env={env!r} must be a dict of str → str (environment variables)")
    deadline = time.monotonic() + timeout
    kernel = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=_ThisPython())
    client = NotebookClient(
        nb,
        km=kernel,
        allow_errors=True,
        startup_timeout=math.ceil(timeout),
        extra_arguments=["--IPKernelApp.log_level=ERROR"],  # not its "running over TCP without encryption" warning
        shutdown_kernel="immediate",  # kill the kernel's process group at once, ranks it started included
        resources={"metadata": {"path": str(folder)}},
    )
    started = False
    try:
        with client.setup_kernel(cleanup_kc=True, env={**os.environ, **(env or {})}):
            started = True
            for index, cell in enumerate(nb.cells):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return _timeout(index, timeout, f"before cell {index + 1}")
                client.timeout = math.ceil(remaining)
                try:
                    client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
                except CellTimeoutError:
                    return _timeout(index, timeout, f"cell {index + 1} was still running")
                except DeadKernelError:
                    reason = f"DeadKernelError: the kernel died while running cell {index + 1}"
                    return Stop(index, reason, False)
    except RuntimeError as e:  # jupyter_client reports a kernel that fails to start as RuntimeError
        if started:
            raise
        if time.monotonic() >= deadline:
            return _timeout(0, timeout, "the kernel had not started")
        return Stop(0, f"the kernel did not start: {e}", False)
    return None


class _ThisPython(KernelSpecManager):
    """Kernel specs where ``python3`` is always this interpreter (the one that has llmlab installed).

    Otherwise a ``python3`` kernelspec registered elsewhere (``ipykernel install --user`` from another
    environment) would run the learner's notebook in a Python without llmlab or torch.
    """

    def get_kernel_spec(self, kernel_name):
        if kernel_name == "python3":
            return self.kernel_spec_class(resource_dir=RESOURCES, **get_kernel_dict())
        return super().get_kernel_spec(kernel_name)


def _timeout(cell: int, timeout: float, where: str) -> Stop:
    return Stop(cell, f"TimeoutError: the notebook did not finish within {timeout:g} s ({where})", True)


def _rows(nb, stop: Stop | None) -> list[Row]:
    owners = cell_exercises(nb)
    records: dict[str, list[dict]] = {}
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            record = output.get("data", {}).get(MIME_TYPE)
            if isinstance(record, dict) and "exercise" in record and record.get("status") in _WORST_FIRST:
                records.setdefault(str(record["exercise"]), []).append(record)
    titles = {}  # exercise id -> heading title, in notebook order
    for owner in owners:
        if owner is not None:
            titles.setdefault(owner.id, owner.title)
    rows = []
    for exercise, title in titles.items():
        if exercise in records:
            rows.append(_worst(records[exercise], title))
        else:
            cells = [i for i, owner in enumerate(owners) if owner is not None and owner.id == exercise]
            rows.append(Row(exercise, title, ERROR, _why_unchecked(nb, cells, stop)))
    for exercise, found in records.items():  # checks run outside any heading still count
        if exercise not in titles:
            rows.append(_worst(found, str(found[0].get("title", ""))))
    return rows


def _worst(records: list[dict], title: str) -> Row:
    """One exercise's row from its records: the worst status wins (failed, not attempted, passed)."""
    record = min(records, key=lambda r: _WORST_FIRST.index(r["status"]))
    return Row(str(record["exercise"]), title, record["status"], str(record.get("detail", "")))


def _why_unchecked(nb, cells: list[int], stop: Stop | None) -> str:
    """Why an exercise whose cells are `cells` has no check record."""
    own = _first_error(nb, cells)
    if own:
        return own
    if stop is not None and stop.cell <= cells[-1]:
        return f"not run: {stop.reason}"
    earlier = _first_error(nb, range(cells[0]))
    if earlier:
        return f"not checked: an earlier cell failed: {earlier}"
    return "no check ran for this exercise (is its check cell missing?)"


def cell_errors(nb, cells=None):
    """(cell index, exception name, message) of every error output of the executed `nb` (of `cells`, if given)."""
    for index in range(len(nb.cells)) if cells is None else cells:
        for output in nb.cells[index].get("outputs", []):
            if output.get("output_type") == "error":
                yield index, output.get("ename"), output.get("evalue")


def _first_error(nb, cells) -> str:
    index, name, message = next(cell_errors(nb, cells), (None, None, None))
    return "" if index is None else f"{name}: {message} (cell {index + 1})"
