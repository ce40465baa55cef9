"""A chapter's exercises as the project defines them: read from its solution notebook, never from a submission.

``llmlab grade`` believes nothing a learner's notebook says about which exercises there are or how they are
checked (nbgrader's autograder works the same way: its test cells are restored from the source). For every
``### Exercise N.M`` heading of ``solutions/NN_topic.ipynb``, :func:`read` takes from the solution:

- the exercise's id and title;
- its *check call*: the one code cell of the exercise whose whole code is a call ``check.NAME(answer, ...)``
  (``check.ring_reduce_scatter(ring_reduce_scatter)``);
- the statement that binds ``check`` before the first exercise (``from llmlab.checks import ch04 as check``).

The statement and the call, as the solution writes them, are the exercise's *official check*: the grader runs
that code itself, so a learner's ``check = my_module`` or an edited check cell changes nothing.

:func:`schedule` decides where in a submission each official check runs. A submission's *check cell* for an
exercise is a code cell whose whole code is a call of that exercise's ``check.NAME`` (the call as generated, or
edited: ``check.logsumexp(log_sum_exp)``); the official check runs in place of the first one, and every copy is
left out (an edited copy never runs). Without one, it runs after the last cell under the exercise's heading.
An exercise with neither its heading nor its check cell in the submission is not in it: not attempted.
(Cells are found by what they are, not by their positional ``cell-N`` ids, which shift whenever a solution
gains a cell: a notebook built from an older solution would have its answer cell taken for a check cell.)

:func:`run` runs one official check in the kernel as a request of the grader's own, not as a notebook cell: what
the check records is captured inside the kernel while it runs and comes back in the *reply* to that request
(``user_expressions``), never from the outputs the notebook displays.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

from nbformat.v4 import new_code_cell

from llmlab.checks import MIME_TYPE
from llmlab.exercises.notebooks import NotebookError, _where, cell_exercises, read_notebook

CHECK = "check"  # the name a notebook binds its chapter's checks to
# Sent to the kernel as the grader's own request: run the official check with every output captured, keep its
# check records, and leave them in a variable the request's reply carries back (user_expressions).
_RUN_CHECK = '''\
def _llmlab_official_check(code, mime):
    import json
    from IPython.utils.capture import capture_output
    from llmlab.checks import ExerciseFailed
    raised = None
    with capture_output() as captured:
        try:
            exec(compile(code, "<official check>", "exec"), globals())
        except ExerciseFailed:
            pass  # a failed check raises it after recording it
        except BaseException as e:  # the check did not finish (or did not start)
            raised = f"{type(e).__name__}: {e}"
    return json.dumps({"records": [o.data[mime] for o in captured.outputs if mime in o.data], "raised": raised})
_llmlab_outcome = _llmlab_official_check(%r, %r)
'''


@dataclass(frozen=True)
class Official:
    """One exercise of a chapter: its id, title, check function's name and the code the grader runs."""

    exercise: str
    title: str
    function: str  # NAME of check.NAME
    code: str  # the statement binding `check`, then the check call

    def is_check_cell(self, cell) -> bool:
        """True when `cell` is a copy (as generated, or edited) of this exercise's check cell."""
        return cell.cell_type == "code" and _check_call(cell.source) == self.function


def read(solution: Path) -> list[Official]:
    """The exercises of the chapter whose solution notebook is `solution`, in order, with their official checks."""
    solution = Path(solution)
    nb = read_notebook(solution)
    owners = cell_exercises(nb)
    headings = [owner for index, owner in enumerate(owners) if owner is not None and owner.cell == index]
    if not headings:
        raise NotebookError(f"{solution}: no exercise: no markdown heading like `### Exercise 1.1: Title`")
    binding = _binding(nb, headings[0].cell, solution)
    officials = []
    for heading in headings:
        calls = [
            (index, cell) for index, (cell, owner) in enumerate(zip(nb.cells, owners, strict=True))
            if owner == heading and cell.cell_type == "code" and _check_call(cell.source)
        ]
        if len(calls) != 1:
            raise NotebookError(
                f"{_where(solution, nb, heading.cell)}: {heading.label} has {len(calls)} check cells; exactly one "
                f"code cell of an exercise is a call `{CHECK}.NAME(answer, ...)` and nothing else"
            )
        (index, cell), = calls
        officials.append(Official(heading.id, heading.title, _check_call(cell.source),
                                  f"{binding}\n{cell.source.strip()}"))
    return officials


def schedule(nb, officials: list[Official]) -> list[int | Official]:
    """The order a submission `nb` runs in: its cell indices, each official check at its place (see the module's
    docstring); the checks of exercises the submission does not have are left out."""
    owners = cell_exercises(nb)
    at: dict[int, list[Official]] = {}  # cell index -> the official checks that run there
    copies = set()  # indices of the submission's own check cells, which do not run
    for official in officials:
        found = [index for index, cell in enumerate(nb.cells) if official.is_check_cell(cell)]
        under = [index for index, owner in enumerate(owners) if owner is not None and owner.id == official.exercise]
        copies.update(found)
        if found:
            at.setdefault(found[0], []).append(official)
        elif under:
            at.setdefault(under[-1], []).append(official)
    steps: list[int | Official] = []
    for index in range(len(nb.cells)):
        if index not in copies:
            steps.append(index)
        steps += at.get(index, [])
    return steps


def run(client, official: Official) -> dict:
    """Run `official`'s check in the kernel of `client` (an nbclient NotebookClient) as a request of its own;
    return its outcome, from the reply: {"records": what the check recorded, "raised": None, or why it did not
    finish}. Raises what nbclient's cell execution raises on a timeout or a dead kernel."""
    cell = new_code_cell(_RUN_CHECK % (official.code, MIME_TYPE))
    msg_id = client.kc.execute(cell.source, store_history=False, allow_stdin=False, stop_on_error=False,
                               user_expressions={"outcome": "_llmlab_outcome"})
    reply = client.wait_for_reply(msg_id, cell)
    outcome = (reply or {}).get("content", {}).get("user_expressions", {}).get("outcome", {})
    try:
        found = json.loads(ast.literal_eval(outcome["data"]["text/plain"]))
        return {"records": list(found["records"]), "raised": found["raised"]}
    except (KeyError, TypeError, ValueError, SyntaxError):
        return {"records": [], "raised": f"the grader's check request failed ({outcome.get('ename', 'no reply')})"}


def _check_call(source: str) -> str:
    """NAME when `source`'s whole code is one call ``check.NAME(...)`` with at least one argument, else ""."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return ""
    if len(body) != 1 or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Call):
        return ""
    call = body[0].value
    function = call.func
    if not (isinstance(function, ast.Attribute) and isinstance(function.value, ast.Name)
            and function.value.id == CHECK and (call.args or call.keywords)):
        return ""  # `check.close()` (stopping the checks' ranks) checks nothing
    return function.attr


def _binding(nb, first_exercise: int, solution: Path) -> str:
    """The last statement before the first exercise that imports something as `check` (its source line(s))."""
    found = ""
    for cell in nb.cells[:first_exercise]:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)) and any(
                (alias.asname or alias.name) == CHECK for alias in node.names
            ):
                found = ast.get_source_segment(cell.source, node)
    if not found:
        raise NotebookError(
            f"{solution}: no `import ... as {CHECK}` before the first exercise (e.g. "
            f"`from llmlab.checks import ch04 as {CHECK}`): the grader would not know where the checks are"
        )
    return found
