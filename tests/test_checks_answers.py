"""Every exercise check passes each of its reference answers and names each of its planted mistakes, once: the
`ANSWERS` tables of tests/test_checks_chNN.py (tests/check_answers.py). tools/flake.py (`make flake N=300`) runs
the same tables N times on fresh random inputs."""

import importlib

import pytest
from check_answers import Mistake, judge

from llmlab import checks

CHAPTERS = [f"ch{n:02d}" for n in range(1, 9)]


def _answers():
    for chapter in CHAPTERS:
        table = importlib.import_module(f"test_checks_{chapter}").ANSWERS
        for i, answer in enumerate(table):
            kind = "mistake" if isinstance(answer, Mistake) else "reference"
            yield pytest.param(answer, id=f"{chapter}.{answer.check.__name__}-{kind}{i}")


@pytest.fixture(scope="module", autouse=True)
def ranks():
    yield
    checks.close_clusters()  # the multi-rank checks' ranks, started by the first of them


@pytest.mark.parametrize("answer", list(_answers()))
def test_answer(answer):
    assert judge(answer) == ""
