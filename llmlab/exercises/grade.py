"""Grade a learner's notebook against its chapter's official checks: one row per exercise.

    llmlab grade exercises/04_communication.ipynb [--json] [--report PATH] [--isolate]   # from the project root
    llmlab grade 04_communication                                                        # the same notebook

:func:`grade` takes which exercises there are and how each is checked from the project's solution notebook
(``solutions/<the notebook's name>``, read by :mod:`llmlab.exercises.official`), never from the submission. It runs
a copy of the submission with nbclient (kernel ``python3`` of this interpreter, working directory = the notebook's
folder; the file itself is not modified), leaving out the submission's own check cells, and runs each exercise's
official check itself where it belongs (:func:`official.schedule`), as a request of its own to the kernel: what the
check records is captured inside the kernel while it runs and comes back in the *reply* to that request
(``user_expressions``), so nothing the notebook displays counts. If the check did not finish (the answer raised
``SystemExit``, say), nothing captured counts either, since a learner's thread may display records meanwhile.
Errors do not stop the run (``allow_errors``), but one timeout bounds the whole run, kernel start included.

Each exercise gets one status:

- ``passed``, ``not attempted`` or ``failed``: what its official check recorded (the worst, if several);
- ``not attempted`` also when the exercise is not in the notebook (its heading and check cell were removed);
- ``error``: its check recorded nothing, and the detail says why: an exception in the exercise's own cells or in
  the check (a ``NameError`` from a renamed function), or the run stopping before it.

Not protected: the learner's code runs in the same Python before the checks, so code written to tamper with them
(replace ``llmlab.checks``, patch torch) can fool them (README's "Exercises" says what is protected). The
kernel's processes, memory and reach are bounded by :mod:`llmlab.exercises.sandbox`: every process it started is
stopped before :func:`grade` returns.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ipykernel.kernelspec import RESOURCES, get_kernel_dict
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from traitlets import List, Unicode

from llmlab.checks import FAILED, NOT_ATTEMPTED, PASSED
from llmlab.exercises import official as officials_of
from llmlab.exercises.notebooks import cell_exercises, read_notebook, untouched
from llmlab.exercises.sandbox import Reaper, bubblewrap, memory_limit, physical_memory

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
    """The outcome of grading one notebook against the official checks of `against` (a solution notebook)."""

    notebook: Path
    rows: tuple[Row, ...]
    seconds: float
    stop: Stop | None = None
    against: Path | None = None

    @property
    def all_passed(self) -> bool:
        """True when there is at least one exercise and every exercise passed."""
        return bool(self.rows) and all(row.status == PASSED for row in self.rows)

    @property
    def timed_out(self) -> bool:
        return self.stop is not None and self.stop.timed_out

    def table(self) -> str:
        """A text table: one line per exercise, its detail indented below it."""
        against = f", checked against {self.against}" if self.against else ""
        lines = [f"{self.notebook} (ran in {self.seconds:.1f} s{against})", ""]
        id_width = max((len(row.exercise) for row in self.rows), default=0)
        title_width = max((len(row.title) for row in self.rows), default=0)
        for row in self.rows:
            lines.append(
                f"  {_ICONS[row.status]} {row.exercise:<{id_width}}  {row.title:<{title_width}}  "
                f"{row.status}".rstrip()
            )
            if row.detail:
                lines.append(" " * (id_width + 7) + row.detail)
        if self.stop is not None:
            lines += ["", f"Stopped early: {self.stop.reason}"]
        passed = sum(row.status == PASSED for row in self.rows)
        lines += ["", f"{passed} of {len(self.rows)} exercises passed."]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {
                "notebook": str(self.notebook),
                "against": str(self.against) if self.against else None,
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


def grade(path: Path, timeout: float = 600, *, solution: Path | None = None, memory: int | None = None,
          isolate: bool = False) -> Report:
    """Run the notebook at `path` within `timeout` seconds and report each exercise of its chapter.

    `path` is a notebook, or a chapter's name (``04_communication``: exercises/04_communication.ipynb, see
    :func:`locate`). `solution`: the chapter's solution notebook, whose exercises and checks are the official ones
    (default: ``solutions/<the notebook's file name>`` beside the notebook's folder, else under the working
    directory). `memory`: bytes
    each process of the kernel may allocate (default: this machine's physical memory). `isolate`: run the kernel
    in a bubblewrap sandbox (see :mod:`llmlab.exercises.sandbox`).
    """
    path = locate(path)
    if not timeout > 0:
        raise ValueError(f"timeout={timeout} must be a positive number of seconds")
    nb = read_notebook(path)
    solution = _solution_of(path) if solution is None else Path(solution)
    if not solution.is_file():
        raise FileNotFoundError(
            f"{solution}: no such solution notebook, so the official checks of {path.name} are unknown: grade a "
            f"notebook named as its chapter (NN_topic.ipynb) in a project holding solutions/, or name its solution"
        )
    officials = officials_of.read(solution)
    steps = officials_of.schedule(nb, officials)
    started = time.monotonic()
    memory = physical_memory() if memory is None else memory
    stop, outcomes = _run(nb, steps, path.resolve().parent, timeout, memory=memory, isolate=isolate)
    rows = [_row(nb, official, official in steps, outcomes.get(official.exercise), stop) for official in officials]
    return Report(path, tuple(rows), time.monotonic() - started, stop, solution)


def progress(root: Path | str = ".", timeout: float = 600, **options) -> list[Report]:
    """Every chapter's exercise notebook under `root` (exercises/NN_topic.ipynb) graded against its solution, in
    chapter order. A notebook still as `llmlab exercises build` wrote it holds none of the learner's code: its
    exercises are reported not attempted without running it. `options` go to :func:`grade`."""
    root = Path(root)
    reports = []
    for path in sorted((root / "exercises").glob("[0-9][0-9]_*.ipynb")):
        solution = root / "solutions" / path.name
        if solution.is_file() and untouched(read_notebook(path)):
            rows = tuple(Row(o.exercise, o.title, NOT_ATTEMPTED) for o in officials_of.read(solution))
            reports.append(Report(path, rows, 0.0, against=solution))
        else:
            reports.append(grade(path, timeout, solution=solution, **options))
    if not reports:
        raise FileNotFoundError(f"{root / 'exercises'}: no exercise notebooks (NN_topic.ipynb): run from the project "
                                "root, or `llmlab exercises build` first")
    return reports


def progress_table(reports: list[Report]) -> str:
    """One line per chapter: exercises passed of its total, and each exercise's mark; then the course's total."""
    width = max(len(r.notebook.stem) for r in reports)
    lines = []
    for r in reports:
        passed = sum(row.status == PASSED for row in r.rows)
        marks = " ".join(f"{_ICONS[row.status]}{row.exercise}" for row in r.rows)
        lines.append(f"{r.notebook.stem:<{width}}  {passed:>2} / {len(r.rows):<2}  {marks}")
    passed, total = (sum(sum(row.status == PASSED for row in r.rows) for r in reports),
                     sum(len(r.rows) for r in reports))
    lines += ["", f"{passed} of {total} exercises passed in {len(reports)} chapters."]
    return "\n".join(lines)


def locate(notebook: Path | str) -> Path:
    """The learner's notebook `notebook` names: the path itself, else the chapter's exercise notebook under the
    project root (the working directory) — ``04_communication`` and ``04_communication.ipynb`` both name
    ``exercises/04_communication.ipynb``."""
    path = Path(notebook)
    if path.is_file():
        return path
    name = path.name if path.suffix == ".ipynb" else f"{path.name}.ipynb"
    for candidate in (path.with_name(name), Path("exercises") / name):
        if candidate.is_file():
            return candidate
    return path  # read_notebook names it: no such notebook


def _solution_of(path: Path) -> Path:
    """The official solution of the learner's notebook `path`: solutions/NAME of the project the notebook lies in
    (exercises/ and solutions/ are siblings), else solutions/NAME under the working directory."""
    beside = path.resolve().parent.parent / "solutions" / path.name
    if not beside.is_file():
        return Path("solutions") / path.name
    try:
        return beside.relative_to(Path.cwd().resolve())  # as the report shows it: solutions/NAME from the root
    except ValueError:
        return beside


def execute(nb, folder: Path, timeout: float, env: dict[str, str] | None = None) -> Stop | None:
    """Run every cell of `nb` in place (outputs land in `nb`); say where and why it stopped early, if so.

    Errors in cells do not stop the run; `timeout` bounds all of it, kernel start included; every process the
    kernel started is stopped before it returns. `env`: variables set in the kernel's environment on top of this
    process's (`llmlab site` turns progress bars off with it). What `llmlab site` runs each chapter with.
    """
    return _run(nb, list(range(len(nb.cells))), folder, timeout, env=env)[0]


def _run(nb, steps: list, folder: Path, timeout: float, env: dict[str, str] | None = None,
         memory: int | None = None, isolate: bool = False) -> tuple[Stop | None, dict[str, dict]]:
    """Run `steps` (cell indices of `nb`, and official checks) in one kernel; return where it stopped early (if
    so) and each official check's outcome (exercise -> {"records": [...], "raised": str | None})."""
    if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                               for k, v in env.items())):
        raise ValueError(f"env={env!r} must be a dict of str → str (environment variables)")
    deadline = time.monotonic() + timeout
    scratch = Path(tempfile.mkdtemp(prefix="llmlab-grade-"))  # the connection file (and sockets, sandbox's files)
    try:
        prefix = bubblewrap(scratch, folder) if isolate else []
        kernel = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=_ThisPython(prefix=prefix),
                                    connection_file=str(scratch / "kernel.json"),
                                    transport="ipc" if isolate else "tcp")  # no network in the sandbox
        client = NotebookClient(
            nb,
            km=kernel,
            allow_errors=True,
            startup_timeout=math.ceil(timeout),
            extra_arguments=["--IPKernelApp.log_level=ERROR"],  # not its "running over TCP without encryption"
            shutdown_kernel="immediate",  # kill the kernel's process group at once, ranks it started included
            resources={"metadata": {"path": str(folder)}},
        )
        launch = {"env": {**os.environ, **(env or {})}, **({} if memory is None else
                                                            {"preexec_fn": memory_limit(memory)})}
        with Reaper():
            return _steps(client, nb, steps, deadline, timeout, launch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _steps(client: NotebookClient, nb, steps: list, deadline: float, timeout: float,
           launch: dict) -> tuple[Stop | None, dict[str, dict]]:
    outcomes: dict[str, dict] = {}
    started, index = False, 0
    try:
        with client.setup_kernel(cleanup_kc=True, **launch):
            started = True
            for step in steps:
                index = step if isinstance(step, int) else index
                what = f"cell {index + 1}" if isinstance(step, int) else f"the check of Exercise {step.exercise}"
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return _timeout(index, timeout, f"before {what}"), outcomes
                client.timeout = math.ceil(remaining)
                try:
                    if isinstance(step, int):
                        client.execute_cell(nb.cells[step], step, execution_count=client.code_cells_executed + 1)
                    else:
                        outcomes[step.exercise] = officials_of.run(client, step)
                except CellTimeoutError:
                    return _timeout(index, timeout, f"{what} was still running"), outcomes
                except DeadKernelError:
                    return Stop(index, f"DeadKernelError: the kernel died while running {what}", False), outcomes
    except RuntimeError as e:  # jupyter_client reports a kernel that fails to start as RuntimeError
        if started:
            raise
        if time.monotonic() >= deadline:
            return _timeout(0, timeout, "the kernel had not started"), outcomes
        return Stop(0, f"the kernel did not start: {e}", False), outcomes
    return None, outcomes


class _ThisPython(KernelSpecManager):
    """Kernel specs where ``python3`` is always this interpreter (the one that has llmlab installed), run under
    `prefix` (a sandbox's command line, or nothing).

    Otherwise a ``python3`` kernelspec registered elsewhere (``ipykernel install --user`` from another
    environment) would run the learner's notebook in a Python without llmlab or torch.
    """

    prefix = List(Unicode())

    def get_kernel_spec(self, kernel_name):
        if kernel_name == "python3":
            spec = get_kernel_dict()
            return self.kernel_spec_class(resource_dir=RESOURCES, **{**spec, "argv": self.prefix + spec["argv"]})
        return super().get_kernel_spec(kernel_name)


def _timeout(cell: int, timeout: float, where: str) -> Stop:
    return Stop(cell, f"TimeoutError: the notebook did not finish within {timeout:g} s ({where})", True)


def _row(nb, official, scheduled: bool, outcome: dict | None, stop: Stop | None) -> Row:
    """One exercise's row from its official check's outcome (None: the check did not run)."""
    if not scheduled:
        return Row(official.exercise, official.title, NOT_ATTEMPTED,
                   "not in this notebook: its heading and its check cell were removed")
    cells = [i for i, owner in enumerate(cell_exercises(nb)) if owner is not None and owner.id == official.exercise]
    if outcome is None:
        return Row(official.exercise, official.title, ERROR, f"not run: {stop.reason}" if stop else "not run")
    # The check records exactly once unless something escaped it before it could: then nothing captured counts
    # (a learner's thread may display records meanwhile). Otherwise its record is there, and the worst wins.
    records = [r for r in outcome["records"] if outcome["raised"] is None and isinstance(r, dict)
               and r.get("exercise") == official.exercise and r.get("status") in _WORST_FIRST]
    if records:
        record = min(records, key=lambda r: _WORST_FIRST.index(r["status"]))
        return Row(official.exercise, official.title, record["status"], str(record.get("detail", "")))
    own = _first_error(nb, cells)
    if own:
        return Row(official.exercise, official.title, ERROR, own)
    detail = f"its check raised {outcome['raised']}" if outcome["raised"] else "its check reported nothing"
    earlier = _first_error(nb, range(cells[0] if cells else len(nb.cells)))
    return Row(official.exercise, official.title, ERROR, f"{detail}; an earlier cell failed: {earlier}" if earlier
               else detail)


def cell_errors(nb, cells=None):
    """(cell index, exception name, message) of every error output of the executed `nb` (of `cells`, if given)."""
    for index in range(len(nb.cells)) if cells is None else cells:
        for output in nb.cells[index].get("outputs", []):
            if output.get("output_type") == "error":
                yield index, output.get("ename"), output.get("evalue")


def _first_error(nb, cells) -> str:
    index, name, message = next(cell_errors(nb, cells), (None, None, None))
    return "" if index is None else f"{name}: {message} (cell {index + 1})"
