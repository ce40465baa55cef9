"""The grader: official checks from the project, results the notebook cannot forge, no process left behind.

Grading starts a Jupyter kernel (a few seconds each, torch import included), so only the notebooks that prove
something are graded, all from the fixture project (test_exercises.py): each solution (passes), each generated
exercise (not attempted), a wrong answer with a renamed function (through the CLI), a starter, a timeout, one
notebook with every forgery of the issue, one whose processes try to outlive grading, and one sandboxed.
"""

import json
import os
import shutil
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell
from test_exercises import FIX_THIS, SOLUTIONS, add_starter, copy_fixture, edit_cell, llmlab, write_notebook

from llmlab import cli
from llmlab.checks import MIME_TYPE
from llmlab.exercises import grade, notebooks, official, sandbox

REPOSITORY = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """One copy of the fixture project with exercises/ built, shared by the grading tests (read only)."""
    root = copy_fixture(tmp_path_factory.mktemp("built") / "project")
    notebooks.build(root)
    return root


def learner_copy(built: Path, folder: Path, name: str = "01_softmax.ipynb", of: str = "exercises") -> Path:
    """A learner's copy of a fixture notebook in `folder`, which sits in a copy of the fixture project (the
    notebooks import fixture_checks from the folder above theirs)."""
    path = folder / "project" / "submissions" / name
    if not path.parent.exists():
        copy_fixture(folder / "project")
        path.parent.mkdir()
    shutil.copy(built / of / name, path)
    return path


def insert_cell(path: Path, after: str, source: str) -> None:
    """Insert a code cell holding `source` after the one cell whose source starts with `after`."""
    nb = nbformat.read(path, as_version=4)
    (index,) = [i for i, cell in enumerate(nb.cells) if cell.source.startswith(after)]
    nb.cells.insert(index + 1, new_code_cell(source))
    nbformat.write(nb, path)


# --- the official exercises, from the solution (no kernel) -------------------------------------------------


def test_every_repository_solution_has_one_official_check_per_exercise():
    for solution in sorted((REPOSITORY / "solutions").glob("*.ipynb")):
        headings = [e for i, e in enumerate(notebooks.cell_exercises(notebooks.read_notebook(solution)))
                    if e is not None and e.cell == i]
        found = official.read(solution)
        assert [o.exercise for o in found] == [e.id for e in headings], solution
        chapter = solution.name[:2]
        assert all(o.code.startswith(f"from llmlab.checks import ch{chapter} as check\ncheck.") for o in found)


@pytest.mark.parametrize("cells, message", [
    (["import fixture_checks as check", "### Exercise 1.1: A", "def f():\n    pass"], r"Exercise 1.1: A has 0 check"),
    (["import fixture_checks as check", "### Exercise 1.1: A", "check.a(f)", "check.a(f)"], r"has 2 check cells"),
    (["import fixture_checks", "### Exercise 1.1: A", "check.a(f)"], r"no `import \.\.\. as check`"),
], ids=["no check cell", "two check cells", "no check import"])
def test_a_solution_without_one_clear_check_per_exercise_is_refused(tmp_path, cells, message):
    path = write_notebook(tmp_path / "solutions" / "01_x.ipynb",
                          [(new_markdown_cell if s.startswith("#") else new_code_cell)(s) for s in cells])
    with pytest.raises(notebooks.NotebookError, match=message):
        official.read(path)


def test_schedule_runs_each_official_check_in_place_of_the_check_cell_or_after_the_exercise(built):
    officials = official.read(built / "solutions" / "01_softmax.ipynb")
    nb = nbformat.read(built / "exercises" / "01_softmax.ipynb", as_version=4)
    one, two = officials
    assert official.schedule(nb, officials) == [0, 1, 2, 3, 4, one, 6, 7, two]  # 5 and 8: the check cells
    nb.cells[8].source = "check.logsumexp(log_sum_exp)"  # edited: still its check cell, replaced
    del nb.cells[5]  # 1.1's check cell deleted: its check runs after the exercise's last cell
    assert official.schedule(nb, officials) == [0, 1, 2, 3, 4, one, 5, 6, two]
    del nb.cells[5:]  # 1.2's heading, answer and check deleted: not in the notebook
    assert official.schedule(nb, officials) == [0, 1, 2, 3, 4, one]


# --- grading (each starts a Jupyter kernel) ----------------------------------------------------------------


@pytest.mark.parametrize("name", SOLUTIONS)
def test_every_solution_passes_every_check(built, name):
    path = built / "solutions" / name
    report = grade.grade(path, timeout=120, solution=path)
    assert [(row.exercise, row.status) for row in report.rows] == [(e, "passed") for e in SOLUTIONS[name]]
    assert report.all_passed and report.stop is None
    print(f"{name}: graded in {report.seconds:.1f} s")


@pytest.mark.parametrize("name", SOLUTIONS)
def test_every_generated_exercise_is_not_attempted(built, name):
    report = grade.grade(built / "exercises" / name, timeout=120, solution=built / "solutions" / name)
    assert [(row.exercise, row.status) for row in report.rows] == [
        (e, "not attempted") for e in SOLUTIONS[name]
    ]
    assert not report.all_passed and report.stop is None
    assert f"⏳ {SOLUTIONS[name][0]}  " in report.table()
    print(f"exercises/{name}: graded in {report.seconds:.1f} s")


def forged(exercise: str) -> str:
    record = {"exercise": exercise, "title": "forged", "status": "passed", "detail": ""}
    return f"from IPython.display import display\ndisplay({{{MIME_TYPE!r}: {record!r}}}, raw=True)"


SPAM = """
import threading, time
def spam():  # displays a forged record every 10 ms, also while the grader's check of 1.1 runs
    while True:
        {forged}
        time.sleep(0.01)
threading.Thread(target=spam, daemon=True).start()
"""


ESCAPE_THE_CHECK = """
def softmax(x, dim=-1):  # leaves the check unreported (it catches Exception only) after the thread had time
    time.sleep(0.3)
    raise SystemExit("past the check")
"""


def test_forged_records_edited_and_deleted_checks_do_not_pass(built, tmp_path):
    """The issue's spoofs: a displayed record (3/3 passed), a check cell rewritten to display one, and an
    exercise deleted from the notebook ("all passed, 1/1"); and a thread displaying records while the check runs,
    with an answer that leaves the check before it records anything."""
    learner = learner_copy(built, tmp_path)
    edit_cell(learner, "check.softmax(softmax)", forged("1.1"))  # the unanswered 1.1's check cell, rewritten
    nb = nbformat.read(learner, as_version=4)
    spam = SPAM.format(forged=forged("1.1").replace("\n", "\n        "))
    nb.cells = nb.cells[:6] + [new_code_cell(forged("1.2")), new_code_cell(forged("9.9")),  # 1.2 deleted
                               new_code_cell(spam + ESCAPE_THE_CHECK)]
    nbformat.write(nb, learner)
    report = grade.grade(learner, timeout=120, solution=built / "solutions" / learner.name)
    assert [(row.exercise, row.status, row.detail) for row in report.rows] == [
        ("1.1", "error", "its check raised SystemExit: past the check"),
        ("1.2", "not attempted", "not in this notebook: its heading and its check cell were removed"),
    ]
    assert not report.all_passed and "0 of 2 exercises passed." in report.table()


def test_cli_grade_json_reports_a_wrong_answer_and_a_renamed_function(built, tmp_path):
    learner = learner_copy(built, tmp_path)
    naive = "return x.exp() / x.exp().sum(dim=dim, keepdim=True)  # overflows for large x"
    edit_cell(learner, 'raise NotImplementedError("Exercise 1.1: Softmax")', naive)
    edit_cell(learner, "def logsumexp(", "def log_sum_exp(")
    edit_cell(learner, "check.logsumexp(logsumexp)", "check.logsumexp(log_sum_exp)")  # the check runs as written
    result = llmlab("grade", str(learner), "--json", "--timeout", "120", cwd=learner.parents[1])
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    (softmax, lse) = report["exercises"]
    assert softmax["status"] == "failed" and lse["status"] == "error"
    assert softmax["detail"].startswith("softmax([1000, 1000, -1000]): 2 of 3 values differ")
    assert "got nan, expected 0.5; 2 of them nan or inf" in softmax["detail"]
    assert lse["detail"] == "its check raised NameError: name 'logsumexp' is not defined"
    assert report["all_passed"] is False and report["passed"] == 0 and report["total"] == 2
    assert report["against"] == "solutions/01_softmax.ipynb"


def test_a_chapter_is_graded_by_its_name_from_the_root_and_by_its_file_from_exercises(built, monkeypatch):
    monkeypatch.chdir(built)  # the project root, where JupyterLab's terminal opens
    for name in ("01_softmax", "01_softmax.ipynb"):
        assert grade.locate(name) == Path("exercises/01_softmax.ipynb")
    assert grade.locate("nothing.ipynb") == Path("nothing.ipynb")  # read_notebook then names it
    monkeypatch.chdir(built / "exercises")  # a terminal that went into exercises/: solutions/ is found beside it
    report = grade.grade(Path("01_softmax.ipynb"), timeout=120)
    assert report.against.resolve() == (built / "solutions" / "01_softmax.ipynb").resolve()
    assert [row.status for row in report.rows] == ["not attempted", "not attempted"]


def test_a_starter_runs_once_the_learner_deletes_the_raise_and_is_graded(tmp_path):
    root = copy_fixture(tmp_path / "project")
    add_starter(root)
    notebooks.build(root)
    learner = root / "exercises" / "01_softmax.ipynb"
    edit_cell(learner, 'raise NotImplementedError("Exercise 1.1: Softmax")' + FIX_THIS + "\n    ", "")
    report = grade.grade(learner, timeout=120, solution=root / "solutions" / "01_softmax.ipynb")
    (softmax, lse) = report.rows
    assert softmax.status == "failed" and lse.status == "not attempted"  # the starter's code ran, unchanged
    assert softmax.detail.startswith("softmax([1000, 1000, -1000]): 2 of 3 values differ"), softmax.detail


def test_grading_stops_at_the_timeout_and_reports_it(built, tmp_path, monkeypatch):
    broken = tmp_path / "jupyter" / "kernels" / "python3"  # a python3 kernelspec from "another environment"
    broken.mkdir(parents=True)
    (broken / "kernel.json").write_text(
        json.dumps({"argv": ["/bin/false"], "display_name": "x", "language": "python"})
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))  # the grader must use its own Python anyway
    learner = learner_copy(built, tmp_path)
    insert_cell(learner, "import os", "import time\ntime.sleep(120)")
    report = grade.grade(learner, timeout=5, solution=built / "solutions" / learner.name)
    assert report.timed_out and report.seconds < 30
    assert [row.status for row in report.rows] == ["error", "error"]
    assert report.rows[0].detail.startswith("not run: TimeoutError: the notebook did not finish within 5 s")
    assert "Stopped early: TimeoutError" in report.table()
    assert json.loads(report.to_json())["timed_out"] is True


# --- processes, memory, isolation --------------------------------------------------------------------------

ESCAPES = '''\
import os, resource, subprocess, sys, time
PIDS, REPORT = {pids!r}, {report!r}
def record(pid):
    with open(PIDS, "a") as f:
        f.write(f"{{pid}}\\n")
forger = """
import json, os, sys, time
if os.fork():
    os._exit(0)  # double fork and a new session: nobody's child, in no group of the kernel's
os.setsid()
open(sys.argv[1], "a").write(f"{{os.getpid()}}\\\\n")
while True:  # rewrite the report as the README's batch loop names it
    open(sys.argv[2], "w").write(json.dumps({{"all_passed": True}}))
    time.sleep(0.02)
"""
forker = """
import os, sys, time
while True:  # a new process every 0.2 s
    if os.fork() == 0:
        open(sys.argv[1], "a").write(f"{{os.getpid()}}\\\\n")
        time.sleep(3600)
    time.sleep(0.2)
"""
subprocess.run([sys.executable, "-c", forger, PIDS, REPORT])
record(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"]).pid)
record(subprocess.Popen([sys.executable, "-c", forker, PIDS], start_new_session=True).pid)
limit = resource.getrlimit(resource.RLIMIT_DATA)
try:
    bytearray(3 << 30)
    allocated = "allocated"
except MemoryError:
    allocated = "MemoryError"
with open(PIDS + ".memory", "w") as f:
    f.write(f"{{limit[0]}} {{allocated}}")
started = time.monotonic()  # wait until the forger rewrote the report and the forker forked (at most 60 s)
while time.monotonic() < started + 60 and not (
        len(open(PIDS).read().split()) >= 4 and open(REPORT).read() == '{{"all_passed": true}}'):
    time.sleep(0.05)
'''


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_no_process_outlives_grading_nor_rewrites_the_report_and_memory_is_limited(built, tmp_path):
    learner = learner_copy(built, tmp_path)
    pids, report = tmp_path / "pids", learner.with_suffix(".grade.json")
    report.write_text("")  # as the README's loop's `>` leaves it while grading runs
    insert_cell(learner, "check.softmax(softmax)", ESCAPES.format(pids=str(pids), report=str(report)))
    result = llmlab("grade", str(learner), "--report", str(report), "--memory", "2", "--timeout", "120",
                    cwd=learner.parents[1])
    assert result.returncode == 1, result.stderr  # the exercise notebook: not attempted
    time.sleep(0.5)  # a survivor rewrites the report every 20 ms
    assert json.loads(report.read_text())["exercises"][0]["status"] == "not attempted"
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) >= 4 and not [pid for pid in started if alive(pid)]  # forger, sleeper, forker, its children
    limit, allocated = (pids.parent / "pids.memory").read_text().split()
    assert int(limit) == 2 << 30 and allocated == "MemoryError"


@pytest.mark.parametrize("options, message", [
    (["--isolate"], "isolate needs bubblewrap (`bwrap`), which is not installed: `apt-get install bubblewrap`"),
    (["--memory", "0"], "--memory 0: must be a positive number of GiB"),
    (["--solution", "solutions/02_cross_entropy.ipynb.bak"], "solutions/02_cross_entropy.ipynb.bak: no such "
                                                            "solution notebook, so the official checks of"),
], ids=["isolate without bubblewrap", "no memory", "no solution"])
def test_cli_grade_refuses_what_it_cannot_do_in_one_line(built, tmp_path, monkeypatch, capsys, options, message):
    learner = learner_copy(built, tmp_path)
    monkeypatch.chdir(learner.parents[1])
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # this Python, and no bwrap
    assert cli.main(["grade", str(learner), *options]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"llmlab grade: error: {message}"), err


ISOLATED = '''\
import os, socket
escapes = []
for path in {targets!r}:
    try:
        open(path, "w").write("escaped")
        escapes.append(path)
    except OSError:
        pass
if len(socket.if_nameindex()) > 1:
    escapes.append("a network interface")
try:
    os.kill({grader}, 0)
    escapes.append("the grader's process")
except ProcessLookupError:
    pass
if escapes:
    def softmax(x, dim=-1):  # fails the check, naming what was reached
        raise RuntimeError(f"reached {{escapes}}")
'''


def test_isolate_runs_the_notebook_without_network_writes_or_other_processes(built, tmp_path):
    try:
        sandbox.bubblewrap(tmp_path, tmp_path)
    except sandbox.SandboxUnavailable as e:
        pytest.skip(str(e))
    learner = learner_copy(built, tmp_path, of="solutions")
    project = learner.parents[1]
    targets = [str(project / "fixture_checks.py"), str(learner.with_suffix(".grade.json")),
               str(Path.home() / f".llmlab-escaped-{os.getpid()}")]
    insert_cell(learner, "def softmax(", ISOLATED.format(targets=targets, grader=os.getpid()))
    report = grade.grade(learner, timeout=120, solution=built / "solutions" / learner.name, isolate=True)
    assert [(row.status, row.detail) for row in report.rows] == [("passed", ""), ("passed", "")]
    assert not any(Path(target).exists() and "escaped" in Path(target).read_text() for target in targets)


def test_grade_all_shows_each_chapter_s_progress_and_runs_only_edited_notebooks(tmp_path, monkeypatch, capsys):
    root = copy_fixture(tmp_path / "project")
    notebooks.build(root)
    learner = root / "exercises" / "01_softmax.ipynb"
    edit_cell(learner, 'raise NotImplementedError("Exercise 1.1: Softmax")',
              "return torch.softmax(x, dim=dim)")  # 1.1 answered; 1.2 left; 02 untouched
    reports = grade.progress(root, timeout=120)
    assert [r.notebook.name for r in reports] == list(SOLUTIONS)
    assert [[row.status for row in r.rows] for r in reports] == [["passed", "not attempted"], ["not attempted"]]
    assert reports[0].seconds > 0 and reports[1].seconds == 0  # the untouched notebook was not run
    monkeypatch.chdir(root)
    assert cli.main(["grade", "--all"]) == 1  # not all passed
    table = capsys.readouterr().out
    assert "01_softmax         1 / 2   ✅1.1 ⏳1.2" in table and "02_cross_entropy   0 / 1   ⏳2.1" in table
    assert table.rstrip().endswith("1 of 3 exercises passed in 2 chapters.")
    assert cli.main(["grade", "--all", "01_softmax"]) == 2
    assert "name one NOTEBOOK, or --all" in capsys.readouterr().err
