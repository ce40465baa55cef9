"""What every chapter's exercise-check tests assert: a right answer prints "passed", an unwritten one prints
"not attempted yet", and a wrong one raises ExerciseFailed with a message naming the mistake and a hint.

(Each test module keeps its own `unwritten` answer: a multi-rank check pickles it by reference, and a function
of a test module travels to the ranks where one of a helper module might not be importable.)
"""

import re

import pytest
from check_answers import shows_hint

from llmlab import checks
from llmlab.checks import ExerciseFailed


def passes(check, *answers, capsys):
    check(*answers)
    assert "passed" in capsys.readouterr().out


def not_attempted(check, *answers, capsys):
    check(*answers)
    assert "not attempted yet" in capsys.readouterr().out


def cases_taken(monkeypatch, module, name: str = "_cases") -> list:
    """Count the cases a check takes from `module.name` (a function returning its list of cases): a check that
    answers "not attempted" at once takes at most the first. (Structural, where a wall-clock bound of 1 s failed on
    a machine at load 30.)"""
    taken, original = [], getattr(module, name)

    def counted(*args, **kwargs):
        for case in original(*args, **kwargs):
            taken.append(case)
            yield case

    monkeypatch.setattr(module, name, counted)
    return taken


def fails(check, *answers, match: str, hint: str) -> str:
    checks.forget()  # a first failure: its line shows the nudge
    with pytest.raises(ExerciseFailed) as info:
        check(*answers)
    message = str(info.value)
    assert "failed" in message and shows_hint(info.value, hint), message
    assert re.search(match, message), message
    return message
