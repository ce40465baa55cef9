"""The checker base: how every exercise check tests a learner's answer and reports it.

A check calls the learner's function on fresh random inputs and edge cases, compares each result with
llmlab's reference, and ends with exactly one line::

    ✅ Exercise 4.1 (ring reduce-scatter): passed
    ⏳ Exercise 4.1 (ring reduce-scatter): not attempted yet
    ❌ Exercise 4.1 (ring reduce-scatter): failed — rank 2's shard: ... Hint: ...

Three rules make exercise notebooks work:

- *Not attempted is not an error.* A generated exercise still says ``raise NotImplementedError(...)``; the
  check reports "not attempted yet" and returns, so an exercises/ notebook runs top to bottom. It says so at
  once when that ``raise`` comes first, after at most the given lines' assignments (:func:`unwritten`),
  without running anything.
  The same holds when the ``NotImplementedError`` was raised on another rank and came back as
  ``llmlab.dist.RankError``.
- *A wrong answer raises* :class:`ExerciseFailed` (an ``AssertionError``) with the same line, so the cell
  turns red and ``pytest``/``nbval`` notice.
- *The grader reads a record, not the text.* Inside IPython the line is displayed together with a
  machine-readable ``application/vnd.llmlab.check+json`` record (exercise, title, status, detail), which
  ``llmlab grade`` collects from the executed notebook. Outside IPython the line is printed.

A chapter's checks live in a module of their own (``llmlab/checks/ch04.py``), or in a package of one module
per exercise when they are long (``llmlab/checks/ch03/``), written with :func:`check`::

    @check("1.1", "softmax", hint="subtract the row maximum before exp")
    def softmax(fn):
        x = torch.randn(4, 7)
        assert_close(fn(x), torch.softmax(x, dim=-1), what="softmax of a (4, 7) tensor")

The decorated ``softmax`` is the public check: a notebook calls ``check.softmax(softmax)``. Inside the body,
report a wrong answer by raising :class:`Mismatch` with what differs, or let :func:`assert_close` do it.

**Staged hints.** A check's hint is a :class:`Hint` of three stages, given in turn while a learner repeats the
same mistake: first a *nudge* (where to look), then the *idea*, and only at the third failure the *formula*.
The same mistake is the same ``Mismatch.mistake`` key (a check names the mistakes it recognises) or, without
one, the same message with its numbers left out (the random cases change the numbers, not the mistake). A new
mistake starts again at the nudge; a pass forgets the exercise's count. A ``Mismatch`` may carry a
:class:`Hint` of its own for the one mistake it names.

**A verdict, not a crash.** In IPython a failed check shows its one line and no traceback into this package
(``ExerciseFailed._render_traceback_``); when the learner's own code raised, the traceback shows the learner's
frames only, from their cell.
"""

from __future__ import annotations

import ast
import atexit
import collections
import functools
import inspect
import random
import re
import textwrap
import traceback
from dataclasses import asdict, dataclass

from llmlab import dist

MIME_TYPE = "application/vnd.llmlab.check+json"

PASSED, NOT_ATTEMPTED, FAILED = "passed", "not attempted", "failed"
_ICONS = {PASSED: "✅", NOT_ATTEMPTED: "⏳", FAILED: "❌"}


def fresh_rng() -> random.Random:
    """The random cases of a check: fresh on every run (never seeded), so an answer cannot be tuned to them."""
    return random.Random()


def number(value, what: str) -> float:
    """A learner's answer as a float (an int, a float, a 0-d tensor, a NumPy scalar), else Mismatch naming it."""
    if isinstance(value, bool):
        raise Mismatch(f"{what}: got bool {value!r}, expected a number")
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of more than one element
        raise Mismatch(f"{what}: got {type(value).__name__} {value!r:.80}, expected a number") from None


@dataclass(frozen=True)
class Hint:
    """The hints for one mistake, in the order a learner who repeats it sees them: `nudge` says where to look,
    `idea` what the code must do there, `formula` the exact rule."""

    nudge: str
    idea: str
    formula: str

    def __post_init__(self):
        for name in ("nudge", "idea", "formula"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ValueError(f"Hint's {name} must be a non-empty string, got {getattr(self, name)!r}")

    @property
    def stages(self) -> tuple[str, str, str]:
        return self.nudge, self.idea, self.formula


class Mismatch(Exception):
    """Raised inside a check body: the learner's answer differs from the reference; the message says how.

    `mistake` names a mistake the check recognises (the key its staged hints are counted by); `hint` is that
    mistake's own :class:`Hint`, given instead of the check's."""

    def __init__(self, message: str, *, mistake: str | None = None, hint: Hint | None = None):
        super().__init__(message)
        self.mistake, self.hint = mistake, hint


class ExerciseFailed(AssertionError):
    """Raised by a check when the answer is wrong; its text is the check's one-line report, `hint` the whole
    :class:`Hint` of the mistake (its stages, of which the line shows one)."""

    def __init__(self, line: str, hint: Hint | None = None):
        super().__init__(line)
        self.hint = hint

    def _render_traceback_(self) -> list[str]:
        """What IPython shows for this error: the check has displayed its line already, so nothing more for a
        wrong answer, and for an error in the learner's code its traceback through their frames only (the
        check's own frames, in this package, say nothing about their mistake)."""
        cause = self.__cause__
        if cause is None:
            return []
        frames = [f for f in traceback.extract_tb(cause.__traceback__) if not f.filename.startswith(_PACKAGE)]
        return ["Traceback of your code (most recent call last):\n", *traceback.format_list(frames),
                *traceback.format_exception_only(cause)]


@dataclass(frozen=True)
class Result:
    """What one check concluded. ``detail`` says what differs (empty unless failed)."""

    exercise: str
    title: str
    status: str
    detail: str = ""
    hint: str = ""
    stage: int = 0  # which of the hint's stages `hint` is (1 … 3), 0 for a hint given in one piece

    @property
    def line(self) -> str:
        head = f"{_ICONS[self.status]} Exercise {self.exercise} ({self.title}): "
        if self.status == PASSED:
            return head + "passed"
        if self.status == NOT_ATTEMPTED:
            return head + "not attempted yet"
        text = head + "failed — " + _sentence(self.detail)
        if not self.hint:
            return text
        label = f"Hint {self.stage} of 3" if self.stage else "Hint"
        more = " (the same mistake again shows the next hint)" if 0 < self.stage < 3 else ""
        return f"{text} {label}: {_sentence(self.hint)}{more}"

    def record(self) -> dict[str, str]:
        """The machine-readable form the grader collects (the hint stays in the line)."""
        fields = asdict(self)
        del fields["hint"], fields["stage"]
        return fields


def not_attempted(error: BaseException) -> bool:
    """True when `error` means "the learner has not written this yet".

    That is a ``NotImplementedError`` raised here, or one raised on another rank and re-raised in this process
    by ``llmlab.dist.spawn`` as a ``RankError`` whose ``exc_type`` names it. (``RankError`` is recognised by
    name, so this module does not import ``llmlab.dist`` and its process machinery.)
    """
    if isinstance(error, NotImplementedError):
        return True
    return type(error).__name__ == "RankError" and getattr(error, "exc_type", None) == "NotImplementedError"


def unwritten(answer) -> bool:
    """True when `answer` is a function whose body (after its docstring) is plain assignments, if any, and then
    ``raise NotImplementedError(...)``, as a generated exercise's is (4.1 gives `rank, n = ...`, `chunks = ...`,
    `right, left = ...` before its raise): calling it can only say "not attempted", so a check says so at once,
    without starting the ranks a multi-rank check would run it on. Any other statement before the raise (a call,
    a loop, a return) is the learner's work, run as usual. Decided from the function's source (IPython keeps a
    cell's), and only when its compiled code agrees (it names NotImplementedError); a decorated function, a
    generator, or one whose source cannot be read, is run as usual."""
    if not inspect.isfunction(answer) or "NotImplementedError" not in answer.__code__.co_names \
            or inspect.isgeneratorfunction(answer):
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(answer)))
    except (OSError, TypeError, SyntaxError):  # no source (exec'd code), or a lambda's line cut mid-expression
        return False
    node = tree.body[0] if tree.body else None
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.decorator_list \
            or node.name != answer.__name__:
        return False
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    first = next((s for s in body if not isinstance(s, ast.Assign | ast.AnnAssign)), None)
    if not isinstance(first, ast.Raise) or first.exc is None:
        return False
    raised = first.exc.func if isinstance(first.exc, ast.Call) else first.exc
    return isinstance(raised, ast.Name) and raised.id == "NotImplementedError"


def check(exercise: str, title: str, *, hint: Hint | str = ""):
    """Turn a check body into a public check that reports one line for exercise `exercise`.

    The body receives the learner's function(s) and raises :class:`Mismatch` (directly or through
    :func:`assert_close`) when an answer is wrong. Any other exception escaping the body was raised by the
    learner's code: it fails the check with its type and message, and stays chained for the traceback.
    `hint` is a staged :class:`Hint` (a plain string is one hint, given at every failure).
    """
    if not re.fullmatch(r"\d+(\.\d+)+", exercise):
        raise ValueError(f"exercise={exercise!r} is not an exercise id like '4.1'")
    if not isinstance(hint, Hint | str):
        raise TypeError(f"hint={hint!r} must be a Hint or a string")

    def decorate(body):
        @functools.wraps(body)
        def run(*answers, **options) -> None:
            if any(unwritten(answer) for answer in (*answers, *options.values())):
                _report(Result(exercise, title, NOT_ATTEMPTED))  # at once: no ranks started to learn it
                return
            try:
                body(*answers, **options)
            except Mismatch as e:
                _fail(exercise, title, str(e), e.mistake, e.hint or hint, cause=None)
            except Exception as e:
                if not_attempted(e):
                    _report(Result(exercise, title, NOT_ATTEMPTED))
                else:
                    _fail(exercise, title, f"your code raised {type(e).__name__}: {e}", None, hint, cause=e)
            else:
                forget(exercise)
                _report(Result(exercise, title, PASSED))

        run.hint = hint
        return run

    return decorate


def assert_close(actual, expected, *, what: str, rtol: float = 1.3e-6, atol: float = 1e-5) -> None:
    """Raise :class:`Mismatch` unless `actual` matches `expected` in shape, dtype and value.

    Values match where ``|actual - expected| <= atol + rtol * |expected|`` (NaN matches NaN). The defaults are
    ``torch.testing``'s float32 tolerances: a few units in the last place, which a correct float32
    implementation meets even when it sums in a different order. Pass ``rtol=0, atol=0`` for exact results.
    The message names `what` was compared, how many values differ, the first differing index with both
    values, and the largest absolute and relative differences (or how many differing values are nan or inf).
    """
    import torch  # here, not at the top, so that the grader can read this module's constants without torch

    if not isinstance(expected, torch.Tensor):
        expected = torch.as_tensor(expected)
    if not isinstance(actual, torch.Tensor):
        try:
            actual = torch.as_tensor(actual, dtype=expected.dtype)
        except (TypeError, ValueError, RuntimeError):
            raise Mismatch(
                f"{what}: got {type(actual).__name__}, expected a tensor of shape {tuple(expected.shape)}"
            ) from None
    if actual.shape != expected.shape:
        raise Mismatch(f"{what}: got shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise Mismatch(f"{what}: got dtype {actual.dtype}, expected {expected.dtype}")
    got, want = actual.detach().cpu().double(), expected.detach().cpu().double()
    differs = ~torch.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    if not differs.any():
        return
    first = tuple(int(i) for i in differs.nonzero()[0])
    abs_diff = (got - want).abs()[differs]
    rel_diff = abs_diff / want.abs()[differs]
    finite = abs_diff.isfinite()
    summary = []
    if finite.any():
        largest_abs, largest_rel = abs_diff[finite].max().item(), rel_diff[finite].max().item()
        summary.append(f"max abs diff {largest_abs:.3g}, max rel diff {largest_rel:.3g}")
    if not finite.all():
        summary.append(f"{int((~finite).sum())} of them nan or inf")
    raise Mismatch(
        f"{what}: {int(differs.sum())} of {differs.numel()} values differ (rtol={rtol:g}, atol={atol:g}); "
        f"first at index {first}: got {got[first].item():.6g}, expected {want[first].item():.6g}; "
        + "; ".join(summary)
    )


_PACKAGE = __file__.rsplit("/", 1)[0] + "/"  # this package's folder: frames in it are the checks' own
_repeats: collections.Counter = collections.Counter()  # (exercise, mistake) -> failures with it in a row


def forget(exercise: str | None = None) -> None:
    """Start `exercise`'s hints (every exercise's, without one) again from the nudge."""
    for key in [k for k in _repeats if exercise is None or k[0] == exercise]:
        del _repeats[key]


def _fail(exercise: str, title: str, detail: str, mistake: str | None, hint: Hint | str,
          cause: BaseException | None):
    """Report a failed check with the hint's stage for this mistake and raise it; `cause` (the learner's own
    exception) stays in the traceback."""
    key = (exercise, mistake or re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", detail))
    if isinstance(hint, Hint):
        for other in [k for k in _repeats if k[0] == exercise and k != key]:
            del _repeats[other]  # another mistake: its count starts again
        _repeats[key] += 1
        stage = min(_repeats[key], 3)
        result = Result(exercise, title, FAILED, detail, hint.stages[stage - 1], stage)
    else:
        result = Result(exercise, title, FAILED, detail, hint)
    _report(result)
    raise ExerciseFailed(result.line, hint if isinstance(hint, Hint) else None) from cause


def _report(result: Result) -> None:
    """Show the line; inside IPython, attach the record the grader collects."""
    if _in_ipython():
        from IPython.display import display  # IPython is there: _in_ipython() found it

        display({MIME_TYPE: result.record(), "text/plain": result.line}, raw=True)
    else:
        print(result.line)


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython  # may be absent: checks also run in plain Python (pytest, the ranks)
    except ImportError:
        return False
    return get_ipython() is not None


def _sentence(text: str) -> str:
    """One line ending in punctuation: newlines in a message would break the one-line report."""
    text = re.sub(r"\s*\n\s*", " ", text.strip())
    return text if text.endswith((".", "!", "?")) else text + "."


_clusters: dict = {}  # world size -> the Cluster the multi-rank checks share


def cluster(world_size: int):
    """A gloo `llmlab.dist.Cluster` of `world_size` ranks for multi-rank checks: started on first use, shared by
    every chapter's checks, stopped by `close_clusters()` or at interpreter exit. gloo, because the checks'
    tensors are CPU tensors on any machine, GPUs or not."""
    if world_size not in _clusters:
        if not _clusters:
            atexit.register(close_clusters)
        _clusters[world_size] = dist.Cluster(world_size, backend="gloo")
    return _clusters[world_size]


def close_clusters() -> None:
    """Stop the checks' ranks now (the next multi-rank check starts new ones)."""
    while _clusters:
        _clusters.popitem()[1].close()
