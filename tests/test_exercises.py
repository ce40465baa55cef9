"""The exercise round trip: solutions/ -> exercises/ (build, check) and the checker base.

The fixture project (tests/fixtures/exercises_project) is a real, small one: two solution notebooks
(softmax and log-sum-exp; cross-entropy) whose checks in fixture_checks.py compare against torch. Tests
work on a copy of it in a temporary directory. The grader's tests (which start kernels) are in
test_exercises_grade.py, on the same fixture.
"""

import functools
import importlib
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
import torch
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from llmlab import checks
from llmlab.checks import ExerciseFailed, Hint, Mismatch, Result, assert_close, check, not_attempted
from llmlab.exercises import grade, notebooks

FIXTURE = Path(__file__).parent / "fixtures" / "exercises_project"
SOLUTIONS = {"01_softmax.ipynb": ["1.1", "1.2"], "02_cross_entropy.ipynb": ["2.1"]}
LLMLAB = Path(sys.executable).with_name("llmlab")  # the console script installed next to this interpreter


def copy_fixture(destination: Path) -> Path:
    shutil.copytree(FIXTURE, destination, ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
    return destination


@pytest.fixture
def project(tmp_path) -> Path:
    """A fresh copy of the fixture project (solutions/ only)."""
    return copy_fixture(tmp_path / "project")


def write_notebook(path: Path, cells) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(new_notebook(cells=cells), path)
    return path


def edit_cell(path: Path, old: str, new: str) -> None:
    """Replace `old` by `new` in the one cell of the notebook at `path` holding it, as an editor would."""
    nb = nbformat.read(path, as_version=4)
    (cell,) = [cell for cell in nb.cells if old in cell.source]
    cell.source = cell.source.replace(old, new)
    nbformat.write(nb, path)


def llmlab(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LLMLAB), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


# --- build -------------------------------------------------------------------------------------------------


def test_build_is_deterministic(project, tmp_path):
    paths = notebooks.build(project)
    assert [p.relative_to(project).as_posix() for p in paths] == [f"exercises/{n}" for n in SOLUTIONS]
    first = [p.read_bytes() for p in paths]
    notebooks.build(project)
    assert [p.read_bytes() for p in paths] == first
    elsewhere = copy_fixture(tmp_path / "elsewhere")  # the root's location is not part of the output
    assert [p.read_bytes() for p in notebooks.build(elsewhere)] == first


def test_build_replaces_each_solution_region_and_strips_outputs(project):
    notebooks.build(project)
    text = (project / "exercises" / "01_softmax.ipynb").read_text(encoding="utf-8")
    assert text.endswith("}\n")
    nb = nbformat.reads(text, as_version=4)
    header = nb.cells[0]
    assert header.cell_type == "markdown"
    # it says to type into this file, that a build keeps an edited one, and the grade command as typed at the root
    assert "Type your answers into this file" in header.source and "do not edit" not in header.source
    assert "never overwrites a notebook you have edited" in header.source
    assert "`llmlab grade exercises/01_softmax.ipynb`" in header.source
    assert "generated from `solutions/01_softmax.ipynb` by `llmlab exercises build`" in header.source
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert all(cell.outputs == [] and cell.execution_count is None for cell in code)
    assert code[1].source == (
        "def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:\n"
        '    """Softmax of `x` along `dim`, correct for logits of any size."""\n'
        '    raise NotImplementedError("Exercise 1.1: Softmax")'
    )
    assert 'raise NotImplementedError("Exercise 1.2: Numerically stable log-sum-exp")' in code[3].source
    assert "SOLUTION" not in text and "amax" not in text  # no marker, no line of any answer
    two = nbformat.read(project / "exercises" / "02_cross_entropy.ipynb", as_version=4)
    assert two.cells[4].source.count('raise NotImplementedError("Exercise 2.1: Cross-entropy")') == 2


def test_build_keeps_the_indentation_of_the_begin_line(project):
    for old in (project / "solutions").iterdir():
        old.unlink()
    method = "class Ring:\n    def reduce_scatter(self, x):\n        ### BEGIN SOLUTION\n        return x\n"
    method += "        ### END SOLUTION\n"
    solution = new_code_cell(method, execution_count=3)
    solution.outputs = [nbformat.v4.new_output("stream", text="leftover output\n")]
    write_notebook(
        project / "solutions" / "04_ring.ipynb", [new_markdown_cell("## Exercise 4.1 — Ring"), solution]
    )
    (path,) = notebooks.build(project)
    cell = nbformat.read(path, as_version=4).cells[2]
    assert cell.source == "class Ring:\n    def reduce_scatter(self, x):\n" + (
        '        raise NotImplementedError("Exercise 4.1: Ring")\n'
    )
    assert cell.outputs == [] and cell.execution_count is None


STARTER = (  # a starter for exercise 1.1 (the naive softmax, to be fixed), as a solution notebook writes one
    "    ### BEGIN STARTER\n"
    "    # e = x.exp()  # overflows for large logits\n"
    "    #\n"
    "    # return e / e.sum(dim=dim, keepdim=True)\n"
    "    ### END STARTER\n"
)
FIX_THIS = "  # delete this line, then fix the code below"


def add_starter(root: Path) -> None:
    """Give exercise 1.1 of the fixture's 01_softmax solution a starter, just before its END SOLUTION line."""
    edit_cell(root / "solutions" / "01_softmax.ipynb", "keepdim=True)\n    ### END SOLUTION",
              "keepdim=True)\n" + STARTER + "    ### END SOLUTION")


def test_build_writes_a_starter_uncommented_after_the_raise_and_leaves_the_answer_out(project):
    add_starter(project)
    notebooks.build(project)
    text = (project / "exercises" / "01_softmax.ipynb").read_text(encoding="utf-8")
    nb = nbformat.reads(text, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code[1].source == (
        "def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:\n"
        '    """Softmax of `x` along `dim`, correct for logits of any size."""\n'
        '    raise NotImplementedError("Exercise 1.1: Softmax")' + FIX_THIS + "\n"
        "    e = x.exp()  # overflows for large logits\n"
        "\n"
        "    return e / e.sum(dim=dim, keepdim=True)"
    )
    assert code[3].source.endswith('    raise NotImplementedError("Exercise 1.2: Numerically stable log-sum-exp")')
    assert "SOLUTION" not in text and "STARTER" not in text and "amax" not in text and "shifted" not in text
    assert "Where code follows the `raise`, that code is yours to fix" in nb.cells[0].source
    other = nbformat.read(project / "exercises" / "02_cross_entropy.ipynb", as_version=4)
    assert "Where code follows" not in other.cells[0].source  # only a notebook with a starter says so
    solution = nbformat.read(project / "solutions" / "01_softmax.ipynb", as_version=4)
    namespace = {"torch": torch}
    exec(solution.cells[3].source, namespace)  # the solution runs its answer; the starter there is a comment
    assert torch.allclose(namespace["softmax"](torch.tensor([1000.0, 0.0])), torch.tensor([1.0, 0.0]))


# --- check -------------------------------------------------------------------------------------------------


def test_the_repository_exercises_are_built_from_its_solutions():
    """What CI checks first: exercises/ is what `llmlab exercises build` writes from solutions/ (a change made in
    both by hand, e.g. a renamed import, leaves the recorded source hash stale)."""
    assert notebooks.check(Path(__file__).resolve().parent.parent) == []


def test_every_chapter_has_three_exercises_one_a_build_and_each_says_its_time():
    """Issue 28: in every chapter ≥ 3 exercises, ≥ 1 of them a build exercise (20–80 reference lines: the learner
    writes the core of the technique), and every exercise states an estimated time ("*About N minutes.*")."""
    root = Path(__file__).resolve().parent.parent
    solutions = sorted((root / "solutions").glob("[0-9][0-9]_*.ipynb"))
    assert len(solutions) == 8
    for path in solutions:
        nb = notebooks.read_notebook(path)
        exercises = {e.id: e for e in notebooks.cell_exercises(nb) if e is not None}
        lines = notebooks.reference_lines(nb)
        assert len(exercises) >= 3, path.name
        assert max(lines.values()) >= 20, (path.name, lines)
        assert max(lines.values()) <= 80, (path.name, lines)
        for exercise in exercises.values():
            text = nb.cells[exercise.cell].source
            heading = text[text.index(f"Exercise {exercise.id}"):]  # its own part of the cell, not the section's
            assert re.search(r"About \d+(–\d+)? minutes\.", heading), (path.name, exercise.id)


def test_reference_lines_count_code_inside_solution_regions_only():
    nb = new_notebook(cells=[
        new_markdown_cell("### Exercise 1.1: A"),
        new_code_cell("def f(x):\n    ### BEGIN SOLUTION\n    # a comment\n\n    y = x + 1\n    return y\n"
                      "    ### BEGIN STARTER\n    # return x\n    ### END STARTER\n    ### END SOLUTION\nprint(f(1))"),
        new_markdown_cell("### Exercise 1.2: B"),
        new_code_cell("x = 1"),
    ])
    assert notebooks.reference_lines(nb) == {"1.1": 2}


def test_check_passes_right_after_build(project):
    notebooks.build(project)
    assert notebooks.check(project) == []


def test_check_reports_a_missing_exercise(project):
    notebooks.build(project)
    (project / "exercises" / "02_cross_entropy.ipynb").unlink()
    (problem,) = notebooks.check(project)
    assert "exercises/02_cross_entropy.ipynb: missing" in problem


def test_check_reports_an_exercise_stale_after_its_solution_changed(project):
    notebooks.build(project)
    edit_cell(project / "solutions" / "01_softmax.ipynb", "correct for logits of any size", "for any logits")
    (problem,) = notebooks.check(project)
    assert "exercises/01_softmax.ipynb: stale: solutions/01_softmax.ipynb changed" in problem


def test_check_ignores_a_change_inside_a_solution_region(project):
    notebooks.build(project)
    edit_cell(project / "solutions" / "01_softmax.ipynb", "e = shifted.exp()", "e = torch.exp(shifted)")
    assert notebooks.check(project) == []  # the answer is not in the exercise, so it is not stale


def test_check_reports_an_exercise_stale_after_its_starter_changed(project):
    add_starter(project)
    notebooks.build(project)
    assert notebooks.check(project) == []
    edit_cell(project / "solutions" / "01_softmax.ipynb", "# e = x.exp()", "# e = torch.exp(x)")
    (problem,) = notebooks.check(project)  # the starter is in the exercise: changing it makes the exercise stale
    assert "exercises/01_softmax.ipynb: stale: solutions/01_softmax.ipynb changed" in problem


def test_check_reports_a_hand_edited_exercise(project):
    notebooks.build(project)
    edit_cell(
        project / "exercises" / "01_softmax.ipynb", "check.softmax(softmax)", "check.softmax(softmax)  # mine"
    )
    (problem,) = notebooks.check(project)
    assert "exercises/01_softmax.ipynb: hand-edited" in problem and "solutions/01_softmax.ipynb" in problem


def test_check_reports_an_exercise_without_a_solution(project):
    notebooks.build(project)
    (project / "solutions" / "02_cross_entropy.ipynb").unlink()
    (problem,) = notebooks.check(project)
    assert "exercises/02_cross_entropy.ipynb: no solution" in problem


# --- bad input ---------------------------------------------------------------------------------------------

HEADING = ("md", "### Exercise 1.1: Softmax")
BAD_SOLUTIONS = {  # cells as (kind, source), and the error's text after the file name
    "unclosed BEGIN": (
        [HEADING, ("code", "def f():\n    ### BEGIN SOLUTION\n    return 1")],
        r', cell 2 \("def f\(\):"\), line 2: ### BEGIN SOLUTION is never closed',
    ),
    "END without BEGIN": (
        [HEADING, ("code", "def f():\n    return 1\n    ### END SOLUTION")],
        r", cell 2 .*, line 3: ### END SOLUTION without a ### BEGIN SOLUTION",
    ),
    "nested BEGIN": (
        [HEADING, ("code", "def f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n    ### END SOLUTION")],
        r", cell 2 .*, line 3: nested ### BEGIN SOLUTION \(a region is already open since line 2\)",
    ),
    "region outside any exercise": (
        [("md", "## Setup"), ("code", "def f():\n    ### BEGIN SOLUTION\n    ### END SOLUTION")],
        r", cell 2 .*, line 2: solution region outside any exercise",
    ),
    "region at the top level": (
        [HEADING, ("code", "### BEGIN SOLUTION\nx = 1\n### END SOLUTION")],
        r", cell 2 .*, line 1: solution region at the top level",
    ),
    "malformed marker": (
        [HEADING, ("code", "def f():\n    ### BEGIN SOLUTION\n    return 1\n    ## END SOLUTION")],
        r", cell 2 .*, line 4: '## END SOLUTION' looks like a solution marker",
    ),
    "marker in a markdown cell": (
        [HEADING, ("md", "The answer:\n### BEGIN SOLUTION\nIt overflows.\n### END SOLUTION")],
        r", cell 2 .*: a solution marker in a markdown cell",
    ),
    "exercise without a region": (
        [HEADING, ("code", "def f():\n    return 1")],
        r", cell 1 .*: Exercise 1.1: Softmax has no ### BEGIN SOLUTION region",
    ),
    "duplicate exercise id": (
        [HEADING, ("code", "def f():\n    ### BEGIN SOLUTION\n    ### END SOLUTION"), HEADING],
        r", cell 3 .*: Exercise 1.1 is already the heading of cell 1",
    ),
    "no exercise at all": ([("code", "x = 1")], r": no exercise"),
    "starter outside a region": (
        [HEADING, ("code", "def f():\n    ### BEGIN STARTER\n    # return 1\n    ### END STARTER")],
        r", cell 2 .*, line 2: ### BEGIN STARTER outside a solution region",
    ),
    "starter at another indentation": (
        [HEADING, ("code", "def f():\n    ### BEGIN SOLUTION\n    if True:\n        ### BEGIN STARTER\n"
                           "        # return 1\n        ### END STARTER\n    ### END SOLUTION")],
        r", cell 2 .*, line 4: ### BEGIN STARTER must be at the indentation of the ### BEGIN SOLUTION of line 2 "
        r"\(4 spaces\)",
    ),
    "second starter in a region": (
        [HEADING, ("code", "def f():\n    ### BEGIN SOLUTION\n    ### BEGIN STARTER\n    ### END STARTER\n"
                           "    ### BEGIN STARTER\n    ### END STARTER\n    ### END SOLUTION")],
        r", cell 2 .*, line 5: a second ### BEGIN STARTER in the region of line 2",
    ),
    "unclosed starter": (
        [HEADING, ("code", "def f():\n    ### BEGIN SOLUTION\n    ### BEGIN STARTER\n    # return 1\n"
                           "    ### END SOLUTION")],
        r", cell 2 .*, line 5: ### END SOLUTION while the ### BEGIN STARTER of line 3 is still open",
    ),
    "END STARTER without BEGIN STARTER": (
        [HEADING, ("code", "def f():\n    ### BEGIN SOLUTION\n    ### END STARTER\n    ### END SOLUTION")],
        r", cell 2 .*, line 3: ### END STARTER without a ### BEGIN STARTER",
    ),
    "starter line not commented out": (
        [HEADING, ("code", "def f():\n    ### BEGIN SOLUTION\n    return 2\n    ### BEGIN STARTER\n"
                           "    return 1\n    ### END STARTER\n    ### END SOLUTION")],
        r", cell 2 .*, line 5: 'return 1' inside a starter block is not commented out",
    ),
    "malformed starter marker": (
        [HEADING, ("code", "def f():\n    ### BEGIN SOLUTION\n    ### BEGIN STARTER\n    # return 1\n"
                           "    ## END STARTER\n    ### END SOLUTION")],
        r", cell 2 .*, line 5: '## END STARTER' looks like a solution marker",
    ),
    "marker inside a starter": (
        [HEADING, ("code", "def f():\n    ### BEGIN SOLUTION\n    ### BEGIN STARTER\n    # ### END SOLUTION\n"
                           "    ### END STARTER\n    ### END SOLUTION")],
        r", cell 2 .*, line 4: '# ### END SOLUTION' looks like a solution marker",
    ),
    "starter marker in a markdown cell": (
        [HEADING, ("md", "### BEGIN STARTER\n# x = 1\n### END STARTER")],
        r", cell 2 .*: a solution marker in a markdown cell",
    ),
}


@pytest.mark.parametrize("cells, message", BAD_SOLUTIONS.values(), ids=BAD_SOLUTIONS.keys())
def test_build_and_check_refuse_a_bad_solution_naming_file_and_cell(project, cells, message):
    new_cell = {"md": new_markdown_cell, "code": new_code_cell}
    write_notebook(project / "solutions" / "01_bad.ipynb", [new_cell[kind](source) for kind, source in cells])
    for command in (notebooks.build, notebooks.check):
        with pytest.raises(notebooks.NotebookError, match=r"solutions/01_bad\.ipynb" + message):
            command(project)
    assert not (project / "exercises").exists()  # nothing is written when any solution is bad


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"cells": [', r"not a notebook: invalid JSON at line 1, column 12"),
        ('{"hello": "world"}', r"not a notebook: the JSON has no 'cells' list"),
        (
            '{"cells": [{"cell_type": "cod"}], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}',
            "not a valid",
        ),
    ],
    ids=["invalid JSON", "JSON but not a notebook", "invalid notebook"],
)
def test_a_file_that_is_not_a_notebook_is_refused_by_build_and_grade(project, text, message):
    path = project / "solutions" / "01_bad.ipynb"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"solutions/01_bad\.ipynb: " + message):
        notebooks.build(project)
    with pytest.raises(ValueError, match=r"01_bad\.ipynb: " + message):
        grade.grade(path, timeout=30)


def test_a_missing_solutions_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"solutions: no solutions/ directory"):
        notebooks.build(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"nothing\.ipynb: no such notebook"):
        grade.grade(tmp_path / "nothing.ipynb", timeout=30)


# --- the checker base --------------------------------------------------------------------------------------


@check("9.1", "double", hint="multiply by two")
def double_check(fn):
    x = torch.arange(6.0).reshape(2, 3)
    assert_close(fn(x), 2 * x, what="double(x)")


class RankError(RuntimeError):
    """Stands in for llmlab.dist.RankError: recognised by its name and exc_type, as the checker does."""

    def __init__(self, exc_type):
        super().__init__(f"rank 1 raised {exc_type}")
        self.rank, self.exception, self.exc_type, self.remote_traceback = 1, None, exc_type, "Traceback ..."


def raises(error):
    def fn(x):
        raise error

    return fn


def test_a_right_answer_prints_passed(capsys):
    double_check(lambda x: x + x)
    assert capsys.readouterr().out == "✅ Exercise 9.1 (double): passed\n"


@pytest.mark.parametrize(
    "fn",
    [raises(NotImplementedError("Exercise 9.1: Double")), raises(RankError("NotImplementedError"))],
    ids=["NotImplementedError", "RankError from another rank"],
)
def test_an_unwritten_answer_prints_not_attempted_and_does_not_raise(capsys, fn):
    double_check(fn)
    assert capsys.readouterr().out == "⏳ Exercise 9.1 (double): not attempted yet\n"


def _written_later(x):
    """Not yet: its first statement is the raise a generated exercise has."""
    raise NotImplementedError("Exercise 9.1: Double")


def _bare(x):
    raise NotImplementedError


def _given_lines_then_raise(x, group=None):
    """Exercise 4.1's shape: the given lines are assignments, then the raise."""
    rank, n = x.numel(), 2
    chunks: list = x.reshape(-1).tensor_split(n)
    raise NotImplementedError(f"not yet: {rank} {chunks}")


def _starts_then_raises(x):
    x.add_(1)  # the learner's first line: run it, it may raise something else
    raise NotImplementedError(f"not yet: {x}")


def _loops_then_raises(x):
    for _ in range(2):
        x = x + x
    raise NotImplementedError(f"not yet: {x}")


def _generator(x):
    raise NotImplementedError
    yield x


@functools.lru_cache
def _decorated(x):
    raise NotImplementedError


def test_unwritten_reads_the_generated_raise_and_nothing_else():
    assert checks.unwritten(_written_later) and checks.unwritten(_bare) and checks.unwritten(_given_lines_then_raise)
    namespace = {}
    exec("def f(x):\n    raise NotImplementedError\n", namespace)  # no source to read: run as usual
    for answer in (_starts_then_raises, _loops_then_raises, _generator, _decorated, namespace["f"], lambda x: x,
                   raises(NotImplementedError()), len, "def f(): raise NotImplementedError"):
        assert not checks.unwritten(answer), answer


def test_every_generated_exercise_function_reads_as_unwritten(tmp_path, monkeypatch):
    """Each exercise function of exercises/*.ipynb, as generated, is `unwritten`: its check says "not attempted"
    at once, without starting ranks (exercise 4.1's and 4.2's given lines once cost 10 s of ranks each)."""
    import ast

    sources = []
    for path in sorted((Path(__file__).resolve().parent.parent / "exercises").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "code" or cell.source.lstrip().startswith(("%", "!")):
                continue
            sources += [ast.get_source_segment(cell.source, node) for node in ast.parse(cell.source).body
                        if isinstance(node, ast.FunctionDef) and "NotImplementedError" in ast.dump(node)]
    assert len(sources) >= 30, len(sources)  # every chapter's: a parse that found none would pass vacuously
    monkeypatch.syspath_prepend(str(tmp_path))
    read_as_written = []
    for i, source in enumerate(sources):  # a module each: names repeat across chapters (forward, __init__)
        # annotations are not evaluated: a function needs none of its notebook's names to be defined
        (tmp_path / f"stub_{i}.py").write_text(f"from __future__ import annotations\n\n{source}\n")
        name = ast.parse(source).body[0].name
        if not checks.unwritten(getattr(importlib.import_module(f"stub_{i}"), name)):
            read_as_written.append(name)
    assert read_as_written == []


def test_an_unwritten_multi_rank_answer_is_not_attempted_at_once_without_ranks(capsys, monkeypatch):
    from llmlab.checks import ch04

    def no_ranks(*args, **kwargs):
        raise AssertionError("a check started ranks to learn that an answer is unwritten")

    monkeypatch.setattr(checks, "cluster", no_ranks)
    monkeypatch.setattr(checks.dist, "Cluster", no_ranks)
    for answer in (_written_later, _given_lines_then_raise):
        started = time.perf_counter()
        ch04.ring_reduce_scatter(answer)
        assert time.perf_counter() - started < 1.0  # the bound: it reads the source, runs nothing
        assert capsys.readouterr().out == "⏳ Exercise 4.1 (ring reduce-scatter): not attempted yet\n"


def _unwritten_after_a_line(tensor, group):
    tensor.add_(0)  # not an assignment: the check cannot tell from the source, so it runs on the ranks
    raise NotImplementedError(f"Exercise 4.1 on {tensor.numel()} elements")


def test_a_not_implemented_error_raised_on_the_ranks_is_not_attempted(capsys):
    from llmlab.checks import ch04

    ch04.ring_reduce_scatter(_unwritten_after_a_line)  # run on the ranks: their RankError names it
    assert capsys.readouterr().out == "⏳ Exercise 4.1 (ring reduce-scatter): not attempted yet\n"


def test_a_wrong_answer_prints_one_line_and_raises_it(capsys):
    with pytest.raises(ExerciseFailed) as failure:
        double_check(lambda x: 3 * x)
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and str(failure.value) == line.rstrip("\n")
    assert line.startswith("❌ Exercise 9.1 (double): failed — double(x): 5 of 6 values differ")
    assert "first at index (0, 1): got 3, expected 2" in line and "max abs diff 5" in line
    assert line.endswith(". Hint: multiply by two.\n")
    assert isinstance(failure.value, AssertionError)


@pytest.mark.parametrize(
    "error, detail",
    [
        (TypeError("bad operand"), "TypeError: bad operand"),
        (RankError("ValueError"), "RankError: rank 1 raised"),
    ],
)
def test_an_answer_that_raises_fails_with_the_error_chained(capsys, error, detail):
    with pytest.raises(ExerciseFailed, match=f"failed — your code raised {detail}") as failure:
        double_check(raises(error))
    assert failure.value.__cause__ is error
    assert capsys.readouterr().out.startswith("❌ Exercise 9.1 (double): failed")


STAGED = Hint(nudge="look at the factor", idea="doubling is adding a tensor to itself", formula="return 2 * x")


@check("9.2", "staged double", hint=STAGED)
def staged_check(fn):
    x = torch.arange(6.0).reshape(2, 3)
    got = fn(x)
    if torch.equal(got, -2 * x):
        raise Mismatch("the sign is wrong", mistake="sign", hint=Hint("look at the sign", "2, not −2", "+2 · x"))
    assert_close(got, 2 * x, what="double(x)")


def staged_line(fn) -> str:
    with pytest.raises(ExerciseFailed) as failure:
        staged_check(fn)
    return str(failure.value)


def test_a_repeated_mistake_gets_the_next_hint_and_a_new_one_starts_again(capsys):
    """Issue 27: nudge, then idea, then formula while the same mistake repeats (the same message up to its
    numbers: the random cases change them); another mistake starts at the nudge; a pass forgets the count."""
    checks.forget()
    lines = [staged_line(lambda x, k=k: (3 + k) * x) for k in range(4)]  # 3x, 4x, 5x, 6x: one mistake
    assert [line.split("Hint ")[1][:6] for line in lines] == ["1 of 3", "2 of 3", "3 of 3", "3 of 3"]
    assert "look at the factor. (the same mistake again" in lines[0] and "adding a tensor" in lines[1]
    assert lines[2].endswith("Hint 3 of 3: return 2 * x.")
    assert staged_line(lambda x: -2 * x).endswith("the sign is wrong. Hint 1 of 3: look at the sign. (the same "
                                                  "mistake again shows the next hint)")  # its own hints
    assert "Hint 1 of 3: look at the factor" in staged_line(lambda x: 3 * x)  # back to another mistake
    assert "Hint 2 of 3" in staged_line(lambda x: 3 * x)
    staged_check(lambda x: x + x)
    assert "Hint 1 of 3" in staged_line(lambda x: 3 * x)  # passing forgot the count
    capsys.readouterr()


def test_a_failure_shows_no_traceback_of_the_checker_and_the_learners_own_frames_only():
    """In IPython a failed check's traceback is empty for a wrong answer (its line is displayed already) and holds
    only the learner's frames for an error their code raised."""
    with pytest.raises(ExerciseFailed) as wrong:
        staged_check(lambda x: 3 * x)
    assert wrong.value._render_traceback_() == []

    def learners_code(x):
        return x.no_such_method()

    with pytest.raises(ExerciseFailed) as raised:
        staged_check(learners_code)
    shown = "".join(raised.value._render_traceback_())
    assert shown.startswith("Traceback of your code") and "learners_code" in shown and "no_such_method" in shown
    assert "llmlab/checks" not in shown and shown.rstrip().endswith("AttributeError: 'Tensor' object has no "
                                                                   "attribute 'no_such_method'")


def test_hints_refuse_what_is_not_a_hint():
    with pytest.raises(ValueError, match="Hint's idea must be a non-empty string"):
        Hint("a", "", "c")
    with pytest.raises(TypeError, match="hint=3 must be a Hint or a string"):
        check("9.3", "x", hint=3)


def test_not_attempted_recognises_only_not_implemented():
    assert not_attempted(NotImplementedError()) and not_attempted(RankError("NotImplementedError"))
    assert not not_attempted(RankError("ValueError")) and not not_attempted(
        RuntimeError("NotImplementedError")
    )


def test_result_record_is_what_the_grader_reads():
    result = Result("9.1", "double", "failed", "double(x) differs", hint="multiply by two")
    assert result.record() == {
        "exercise": "9.1",
        "title": "double",
        "status": "failed",
        "detail": "double(x) differs",
    }
    assert result.line == "❌ Exercise 9.1 (double): failed — double(x) differs. Hint: multiply by two."


def test_check_refuses_an_id_that_is_not_n_dot_m():
    with pytest.raises(ValueError, match="exercise='4' is not an exercise id"):
        check("4", "ring")


@pytest.mark.parametrize(
    "actual, expected, message",
    [
        (torch.zeros(3), torch.zeros(2, 3), r"^x: got shape \(3,\), expected \(2, 3\)$"),
        (
            torch.zeros(3, dtype=torch.float64),
            torch.zeros(3),
            r"^x: got dtype torch.float64, expected torch.float32$",
        ),
        (None, torch.zeros(3), r"^x: got NoneType, expected a tensor of shape \(3,\)$"),
        (
            torch.tensor([1.0, float("nan")]),
            torch.tensor([1.0, 0.5]),
            r"\(1,\): got nan, expected 0.5; 1 of them nan",
        ),
        (torch.tensor(2.0), torch.tensor(2.5), r"1 of 1 values differ .*index \(\): got 2, expected 2.5"),
    ],
    ids=["shape", "dtype", "not a tensor", "nan", "scalar"],
)
def test_assert_close_says_what_differs(actual, expected, message):
    with pytest.raises(Mismatch, match=message):
        assert_close(actual, expected, what="x")


def test_assert_close_accepts_rounding_and_exact_comparison():
    x = torch.randn(100)
    assert_close(x.exp().log(), x, what="log(exp(x))", rtol=1e-5, atol=1e-6)  # a few float32 roundings
    assert_close([1, 2], torch.tensor([1, 2]), what="exact", rtol=0, atol=0)
    with pytest.raises(Mismatch, match=r"exact: 1 of 2 values differ \(rtol=0, atol=0\)"):
        assert_close(torch.tensor([1, 3]), torch.tensor([1, 2]), what="exact", rtol=0, atol=0)


# --- the CLI -----------------------------------------------------------------------------------------------


def test_cli_exercises_build_and_check(project):
    built = llmlab("exercises", "build", "--root", str(project), cwd=project)
    assert built.returncode == 0 and built.stdout.count("wrote ") == 2, built.stderr
    fresh = llmlab("exercises", "check", "--root", str(project), cwd=project)
    assert fresh.returncode == 0 and "up to date" in fresh.stdout
    edit_cell(project / "solutions" / "02_cross_entropy.ipynb", "# 2 · Cross-entropy", "# 2 · Cross entropy")
    stale = llmlab("exercises", "check", "--root", ".", cwd=project)
    assert stale.returncode == 1 and "exercises/02_cross_entropy.ipynb: stale" in stale.stdout
    assert "run `llmlab exercises build`" in stale.stderr
    write_notebook(project / "solutions" / "03_bad.ipynb", [new_code_cell("x = 1")])
    bad = llmlab("exercises", "build", "--root", ".", cwd=project)
    assert bad.returncode == 2 and "solutions/03_bad.ipynb: no exercise" in bad.stderr


def test_every_exercise_check_gives_staged_hints():
    """Issue 27: every chapter's checks give a nudge, then the idea, then the formula — no check left with one
    hint for every failure, and no stage repeating another."""
    found = []
    for chapter in range(1, 9):
        module = importlib.import_module(f"llmlab.checks.ch{chapter:02d}")
        for name in dir(module):
            fn = getattr(module, name)
            if callable(fn) and hasattr(fn, "hint") and getattr(fn, "__module__", "").startswith("llmlab.checks"):
                found.append(fn)
                assert isinstance(fn.hint, Hint), f"ch{chapter:02d}.{name}: one hint for every failure: {fn.hint!r}"
                assert len(set(fn.hint.stages)) == 3, f"ch{chapter:02d}.{name}: a stage repeats another"
    assert len(set(found)) >= 24
