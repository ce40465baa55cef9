"""The answers every exercise check is tried with: reference answers it must pass, planted mistakes it must name.

Each tests/test_checks_chNN.py lists its chapter's in `ANSWERS`; tests/test_checks_answers.py runs each once, and
tools/flake.py (`make flake N=300`) runs them N times on the checks' fresh random inputs, counting failures::

    ANSWERS = [
        Reference(ch01.block_flops, block_flops),
        Mistake(ch01.block_flops, lambda *a: block_flops(*a) // 2, match="a multiply-add is 2 FLOPs", hint="2·m·n·k"),
    ]

`answers` are the check's arguments (one learner function, or several: 3.3 takes pack and unpack). A mistake is
named when the check fails with a message that matches the regular expression `match` and shows a hint, one of
whose stages (nudge, idea, formula: a repeated mistake is shown the next) holds `hint`.
"""

from __future__ import annotations

import contextlib
import io
import re

from llmlab import checks
from llmlab.checks import ExerciseFailed


class Reference:
    """A right answer: the check must print "passed"."""

    def __init__(self, check, *answers):
        self.check, self.answers = check, answers


class Mistake:
    """A wrong answer: the check must fail, naming it (`match`, a regular expression) and showing the hint."""

    def __init__(self, check, *answers, match: str, hint: str):
        self.check, self.answers, self.match, self.hint = check, answers, match, hint


def shows_hint(failure: ExerciseFailed, hint: str) -> bool:
    """The failure's line shows a hint, and `hint` is in it or in another stage of the same mistake's hints."""
    message = str(failure)
    stages = failure.hint.stages if failure.hint else ()
    return re.search(r"\bHint( \d of 3)?:", message) is not None and any(hint in t for t in (message, *stages))


def judge(answer: Reference | Mistake) -> str:
    """Run the answer's check once: '' when it went as it should, else what went wrong, in one line."""

    out = io.StringIO()
    checks.forget()  # each judgement is a first failure: its line shows the nudge
    try:
        with contextlib.redirect_stdout(out):
            answer.check(*answer.answers)
    except ExerciseFailed as e:
        message = str(e)
        if isinstance(answer, Reference):
            return f"the reference failed: {message}"
        if shows_hint(e, answer.hint) and re.search(answer.match, message):
            return ""
        return f"another failure than /{answer.match}/ (hint {answer.hint!r}): {message}"
    printed = out.getvalue().strip()
    if isinstance(answer, Mistake):
        return f"the mistake /{answer.match}/ was not named: {printed}"
    return "" if printed.endswith(": passed") else f"the reference did not pass: {printed}"
