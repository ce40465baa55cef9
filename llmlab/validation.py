"""Checks of a public function's arguments, with one wording: the argument's name, its value, what it must be.

    from llmlab import validation
    validation.integer("world_size", world_size, low=1)   # world_size=0 must be an int >= 1
    validation.positive_int("n_head", n_head)             # n_head=0 must be a positive int
    validation.number("lr", lr, low=0)                    # lr=-1 must be a number >= 0
    validation.positive("seconds", seconds)               # seconds=0 must be a positive number
    validation.one_of("precision", precision, ("fp32", "bf16", "fp16"))

Each returns the value (a number as given; `number` accepts ints too) so a check can stand in an assignment, and
raises `ValueError` otherwise. A bool is refused where a number is expected: `True` is an int to Python, but
`steps=True` is a mistake, not a step count. `hint` adds the reason a bound has, e.g. "(the number of ranks)".
"""

from __future__ import annotations

import math
from collections.abc import Collection

__all__ = ["integer", "positive_int", "number", "positive", "one_of", "boolean"]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _fail(name: str, value, must: str, hint: str):
    raise ValueError(f"{name}={value!r} must be {must}" + (f" {hint}" if hint else ""))


def _bounds(low, high) -> str:
    if low is not None and high is not None:
        return f" in [{low}, {high}]"
    if low is not None:
        return f" >= {low}"
    if high is not None:
        return f" <= {high}"
    return ""


def integer(name: str, value, low: int | None = None, high: int | None = None, *, hint: str = "") -> int:
    """`value` as an int in [low, high] (either bound may be None: unbounded on that side)."""
    if not _is_int(value) or (low is not None and value < low) or (high is not None and value > high):
        _fail(name, value, "an int" + _bounds(low, high), hint)
    return value


def positive_int(name: str, value, *, hint: str = "") -> int:
    """`value` as an int >= 1."""
    if not _is_int(value) or value < 1:
        _fail(name, value, "a positive int", hint)
    return value


def number(name: str, value, low: float | None = None, high: float | None = None, *, above: float | None = None,
           hint: str = "") -> float | int:
    """`value` as a real number (int or float, not NaN) in [low, high], or strictly greater than `above`."""
    if low is not None and above is not None:
        raise ValueError("number(): give low= or above=, not both")
    ok = _is_number(value) and not math.isnan(value)
    if ok and above is not None:
        ok = value > above
    if ok:
        ok = (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        bound = f" > {above}" + (f" and <= {high}" if high is not None else "") if above is not None \
            else _bounds(low, high)
        _fail(name, value, "a number" + bound, hint)
    return value


def positive(name: str, value, *, hint: str = "") -> float | int:
    """`value` as a real number > 0 (finite or infinite, not NaN)."""
    if not _is_number(value) or not value > 0:
        _fail(name, value, "a positive number", hint)
    return value


def one_of(name: str, value, choices: Collection, *, hint: str = ""):
    """`value` if it is one of `choices` (compared with ==; a bool is not taken for 0 or 1)."""
    if not any(value is c if isinstance(value, bool) or isinstance(c, bool) else value == c for c in choices):
        _fail(name, value, "one of " + ", ".join(map(repr, choices)), hint)
    return value


def boolean(name: str, value, *, hint: str = "") -> bool:
    """`value` if it is True or False (not 0, 1 or None)."""
    if not isinstance(value, bool):
        _fail(name, value, "True or False", hint)
    return value
