"""llmlab.validation: each check accepts what it should, returns it, and refuses the rest naming the argument."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmlab import validation


@given(st.integers(-1000, 1000), st.integers(-10, 10), st.integers(0, 20))
def test_integer_in_range(value, low, width):
    high = low + width
    if low <= value <= high:
        assert validation.integer("n", value, low, high) == value
    else:
        with pytest.raises(ValueError, match=rf"^n={value} must be an int in \[{low}, {high}\]$"):
            validation.integer("n", value, low, high)


@pytest.mark.parametrize("bad", [True, False, 1.0, "3", None, 2.5])
def test_integer_refuses_non_ints(bad):
    with pytest.raises(ValueError, match=r"must be an int >= 0 \(a count\)$"):
        validation.integer("count", bad, low=0, hint="(a count)")


def test_integer_bounds_wording():
    with pytest.raises(ValueError, match=r"^k=9 must be an int <= 4$"):
        validation.integer("k", 9, high=4)
    with pytest.raises(ValueError, match=r"^k='x' must be an int$"):
        validation.integer("k", "x")


@pytest.mark.parametrize("bad", [0, -3, True, 1.0, None])
def test_positive_int(bad):
    assert validation.positive_int("n_head", 7) == 7
    with pytest.raises(ValueError, match=rf"^n_head={bad!r} must be a positive int$"):
        validation.positive_int("n_head", bad)


@pytest.mark.parametrize("good", [0, 0.5, 3, math.inf])
def test_number_accepts(good):
    assert validation.number("lr", good, low=0) == good


@pytest.mark.parametrize("bad", [-1e-9, math.nan, True, "1", None, -math.inf])
def test_number_refuses(bad):
    with pytest.raises(ValueError, match=r"^lr=.* must be a number >= 0$"):
        validation.number("lr", bad, low=0)


def test_number_above_and_high():
    assert validation.number("p", 1.0, above=0, high=1) == 1.0
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match=r"must be a number > 0 and <= 1$"):
            validation.number("p", bad, above=0, high=1)
    with pytest.raises(ValueError, match="not both"):
        validation.number("p", 1, low=0, above=0)


@pytest.mark.parametrize("bad", [0, -1, math.nan, False, "2"])
def test_positive(bad):
    assert validation.positive("seconds", 0.1) == 0.1
    with pytest.raises(ValueError, match=r"^seconds=.* must be a positive number$"):
        validation.positive("seconds", bad)


def test_one_of():
    assert validation.one_of("zero", 2, (0, 1, 2, 3)) == 2
    assert validation.one_of("mode", "auto", ("auto", True, False)) == "auto"
    assert validation.one_of("mode", True, ("auto", True, False)) is True
    for bad in (4, False, "2"):
        with pytest.raises(ValueError, match=r"^zero=.* must be one of 0, 1, 2, 3$"):
            validation.one_of("zero", bad, (0, 1, 2, 3))
    with pytest.raises(ValueError, match="must be one of 'auto', True, False"):
        validation.one_of("mode", 1, ("auto", True, False))


@pytest.mark.parametrize("bad", [0, 1, None, "yes"])
def test_boolean(bad):
    assert validation.boolean("flash", False) is False
    with pytest.raises(ValueError, match=r"^flash=.* must be True or False$"):
        validation.boolean("flash", bad)
