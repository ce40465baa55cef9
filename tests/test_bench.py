"""llmlab.bench.format_table: the plain-text tables every chapter prints; wide ones wrap their headers to fit."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmlab import bench


def test_a_narrow_table_is_one_header_line_numbers_right_text_left():
    text = bench.format_table([{"size": 1, "ms": 0.5}, {"size": 1024, "note": "x"}])
    assert text.splitlines() == ["size   ms  note", "----  ---  ----", "   1  0.5", "1024       x"]
    assert bench.format_table([]) == "(no results)"


def test_long_headers_wrap_until_the_table_fits():
    row = {"stage": "ZeRO-1", "params / grads / optimizer (kB)": "433 / 433 / 866", "per rank": "1.1 kB",
           "measured / formula": "1.0000", "sent per step": "649.7 kB", "formula (2Ψ or 3Ψ)·(N−1)/N": "649.7 kB",
           "sent / formula": "1.0000"}
    lines = bench.format_table([row], width=80).splitlines()
    assert max(map(len, lines)) <= 80 and len(lines) > 3  # headers on more than one line
    rule = next(i for i, line in enumerate(lines) if set(line) <= {"-", " "})
    assert lines[rule + 1].split() == ["ZeRO-1", "433", "/", "433", "/", "866", "1.1", "kB", "1.0000", "649.7", "kB",
                                       "649.7", "kB", "1.0000"]  # values whole, in their columns


@settings(max_examples=60, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["a b c d e f", "long header words here", "x", "y z"]),
                                st.text("abc123 ", max_size=12), min_size=1), min_size=1, max_size=4),
       st.integers(1, 120))
def test_every_word_and_value_survives_and_columns_line_up(rows, width):
    text = bench.format_table(rows, width)
    lines = text.split("\n")  # a row of empty values is an empty line
    rule = next(i for i, line in enumerate(lines) if line and set(line) <= {"-", " "})
    header_words = " ".join(lines[:rule]).split()
    columns = list(dict.fromkeys(k for r in rows for k in r))
    assert header_words == " ".join(" ".join(c.split()) for c in columns).split() or \
        sorted(header_words) == sorted(" ".join(columns).split())  # wrapped headers keep every word
    spans = [m.span() for m in re.finditer(r"-+", lines[rule])]
    assert len(spans) == len(columns)
    for row, line in zip(rows, lines[rule + 1:], strict=True):
        for (start, end), column in zip(spans, columns, strict=True):
            assert line[start:end].strip() == str(row.get(column, "")).strip()  # each value in its own column


def test_bad_width():
    with pytest.raises(ValueError, match="width=0"):
        bench.format_table([{"a": 1}], width=0)
