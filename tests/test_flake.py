"""tools/flake.py, the flaky-check hunt: it counts runs, reference failures and missed mistakes per check, per
chapter and in total, and exits 1 on any failure.

CI runs it on two cheap checks at N=3. `LLMLAB_FLAKE_N=300 pytest tests/test_flake.py` runs every check N times
(as `make flake N=300` does: 16 minutes on 2 cores)."""

import importlib.util
import io
import os
import sys
from pathlib import Path

import pytest
from check_answers import Mistake, Reference

from llmlab.checks import Mismatch, check

ROOT = Path(__file__).resolve().parent.parent


def _load_tool():
    spec = importlib.util.spec_from_file_location("flake", ROOT / "tools" / "flake.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["flake"] = module  # before running it: its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


flake = _load_tool()


def test_two_cheap_checks_at_n_3_pass(capsys):
    assert flake.main(["-n", "3", "-k", "choose_allreduce"]) == 0
    assert flake.main(["-n", "3", "-k", "ch05.compute_seconds"]) == 0
    out = capsys.readouterr().out
    assert "ch04.choose_allreduce" in out and "ch05.compute_seconds" in out
    # the check's row, then its chapter's and the total: 3 runs, no failure
    assert len([line for line in out.splitlines() if line.split()[1:4] == ["3", "0", "0"]]) == 6, out


calls = {"n": 0}


@check("9.9", "a flaky check")
def flaky(fn):
    """Fails the right answer on every third call, and never notices the answer 'wrong'."""
    calls["n"] += 1
    if calls["n"] % 3 == 0:
        raise Mismatch("unlucky draw")
    fn()


def test_a_flaky_reference_and_a_missed_mistake_are_counted_and_fail_the_run():
    calls["n"] = 0
    right, wrong = (lambda: None), (lambda: "wrong")
    tally = flake.hunt("ch09.flaky", [Reference(flaky, right)], [Mistake(flaky, wrong, match="x", hint="y")], 6)
    # 12 calls alternate reference (odd) and mistake (even); calls 3 and 9 fail the reference, and the mistake is
    # never named (calls 6 and 12 fail, but without its message)
    assert (tally.runs, tally.reference_failures, tally.mistakes_missed) == (6, 2, 6)
    assert tally.failures[0].startswith("run 0, mistake 0: the mistake /x/ was not named")
    out = io.StringIO()
    assert flake.report([tally], out=out) == 1
    assert "ch09.flaky: 2 reference failure(s), 6 mistake(s) missed" in out.getvalue()
    assert flake.report([flake.Tally("ch09.fine", runs=6)], out=io.StringIO()) == 0


def test_an_unknown_filter_or_count_is_refused(capsys):
    with pytest.raises(SystemExit):
        flake.main(["-k", "ch99"])
    with pytest.raises(SystemExit):
        flake.main(["-n", "0"])
    err = capsys.readouterr().err
    assert "-k 'ch99' matches no check" in err and "-n must be at least 1, got 0" in err


@pytest.mark.skipif("LLMLAB_FLAKE_N" not in os.environ, reason="opt-in: LLMLAB_FLAKE_N=300 runs every check N times")
def test_every_check_n_times():
    assert flake.main(["-n", os.environ["LLMLAB_FLAKE_N"]]) == 0
