"""The checker base: how every exercise check tests a learner's answer and reports it.

A check calls the learner's function on fresh random inputs and edge cases, compares each result with
llmlab's reference, and ends with exactly one line::

    ✅ Exercise 4.1 (ring reduce-scatter): passed
    ⏳ Exercise 4.1 (ring reduce-scatter): not attempted yet
    ❌ Exercise 4.1 (ring reduce-scatter): failed — rank 2's shard: ... Hint: ...

Three rules make exercise notebooks work:

- *Not attempted is not an error.* A generated exercise still says ``raise NotImplementedError(...)``; the
  check reports "not attempted yet" and returns, so an exercises/ notebook runs top to bottom. The same holds
  when the ``NotImplementedError`` was raised on another rank and came back as ``llmlab.dist.RankError``.
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
"""

from __future__ import annotations

import atexit
import functools
import random
import re
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


class Mismatch(Exception):
    """Raised inside a check body: the learner's answer differs from the reference; the message says how."""


class ExerciseFailed(AssertionError):
    """Raised by a check when the answer is wrong; its text is the check's one-line report."""


@dataclass(frozen=True)
class Result:
    """What one check concluded. ``detail`` says what differs (empty unless failed)."""

    exercise: str
    title: str
    status: str
    detail: str = ""
    hint: str = ""

    @property
    def line(self) -> str:
        head = f"{_ICONS[self.status]} Exercise {self.exercise} ({self.title}): "
        if self.status == PASSED:
            return head + "passed"
        if self.status == NOT_ATTEMPTED:
            return head + "not attempted yet"
        text = head + "failed — " + _sentence(self.detail)
        return f"{text} Hint: {_sentence(self.hint)}" if self.hint else text

    def record(self) -> dict[str, str]:
        """The machine-readable form the grader collects (the hint stays in the line)."""
        fields = asdict(self)
        del fields["hint"]
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


def check(exercise: str, title: str, *, hint: str = ""):
    """Turn a check body into a public check that reports one line for exercise `exercise`.

    The body receives the learner's function(s) and raises :class:`Mismatch` (directly or through
    :func:`assert_close`) when an answer is wrong. Any other exception escaping the body was raised by the
    learner's code: it fails the check with its type and message, and stays chained for the traceback.
    """
    if not re.fullmatch(r"\d+(\.\d+)+", exercise):
        raise ValueError(f"exercise={exercise!r} is not an exercise id like '4.1'")

    def decorate(body):
        @functools.wraps(body)
        def run(*answers, **options) -> None:
            try:
                body(*answers, **options)
            except Mismatch as e:
                _fail(Result(exercise, title, FAILED, str(e), hint), cause=None)
            except Exception as e:
                if not_attempted(e):
                    _report(Result(exercise, title, NOT_ATTEMPTED))
                else:
                    detail = f"your code raised {type(e).__name__}: {e}"
                    _fail(Result(exercise, title, FAILED, detail, hint), cause=e)
            else:
                _report(Result(exercise, title, PASSED))

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


def _fail(result: Result, cause: BaseException | None):
    """Report a failed check and raise it; `cause` (the learner's own exception) stays in the traceback."""
    _report(result)
    raise ExerciseFailed(result.line) from cause


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
