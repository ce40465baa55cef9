"""llmlab.tables: the tables every chapter shows: plain text in a terminal (wide ones wrap their headers to fit),
an HTML table in JupyterLab and on the site, markdown for the README."""

import re
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmlab import tables

WIDE = {"stage": "ZeRO-1", "params / grads / optimizer (kB)": "433 / 433 / 866", "per rank": "1.1 kB",
        "measured / formula": "1.0000", "sent per step": "649.7 kB", "formula (2Ψ or 3Ψ)·(N−1)/N": "649.7 kB",
        "sent / formula": "1.0000"}


def test_a_narrow_table_is_one_header_line_numbers_right_text_left():
    table = tables.format_table([{"size": 1, "ms": 0.5}, {"size": 1024, "note": "x"}])
    assert table.text.splitlines() == ["size   ms  note", "----  ---  ----", "   1  0.5", "1024       x"]
    assert str(table) == repr(table) == table.text  # print and a Python prompt show the text
    assert str(tables.format_table([])) == "(no results)"


def test_cells_round_floats_to_three_digits():
    assert [tables.cell(v) for v in (0.123456, 12345.6, 7, "a b", None)] == ["0.123", "1.235e+04", "7", "a b", "None"]


def test_long_headers_wrap_until_the_table_fits():
    lines = tables.format_table([WIDE], width=80).text.splitlines()
    assert max(map(len, lines)) <= 80 and len(lines) > 3  # headers on more than one line
    rule = next(i for i, line in enumerate(lines) if set(line) <= {"-", " "})
    assert lines[rule + 1].split() == ["ZeRO-1", "433", "/", "433", "/", "866", "1.1", "kB", "1.0000", "649.7", "kB",
                                       "649.7", "kB", "1.0000"]  # values whole, in their columns


@settings(max_examples=60, deadline=None)
@given(st.lists(st.dictionaries(st.sampled_from(["a b c d e f", "long header words here", "x", "y z"]),
                                st.text("abc123 ", max_size=12), min_size=1), min_size=1, max_size=4),
       st.integers(1, 120))
def test_every_word_and_value_survives_and_columns_line_up(rows, width):
    text = tables.format_table(rows, width).text
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


def _html(rows, **kwargs) -> ET.Element:
    return ET.fromstring(tables.format_table(rows, **kwargs)._repr_html_())  # well-formed: it parses as XML


def test_html_is_one_header_row_and_one_row_per_row():
    rows = [{"size": 1, "ms": 0.5}, {"size": 1024, "note": "x"}, {"size": 4096, "ms": 2.25, "note": "y"}]
    table = _html(rows)
    assert table.tag == "table"
    assert [th.text for th in table.iter("th")] == ["size", "ms", "note"]
    body = [[td.text or "" for td in tr.iter("td")] for tr in table.find("tbody")]
    assert body == [["1", "0.5", ""], ["1024", "", "x"], ["4096", "2.25", "y"]]
    assert len(list(table.iter("tr"))) == 1 + len(rows)


def test_html_headers_are_whole_where_the_text_wraps_them():
    assert [th.text for th in _html([WIDE], width=80).iter("th")] == list(WIDE)


def test_html_aligns_numbers_right_and_text_left():
    table = _html([{"size": 1024, "ms": "−0.5", "what": "ring", "when": "—"}, {"size": 2048, "what": "tree"}])
    align = lambda el: el.get("style")
    assert [align(th) for th in table.iter("th")] == ["text-align:right"] * 2 + ["text-align:left", "text-align:right"]
    for tr in table.find("tbody"):
        assert [align(td) for td in tr] == [align(th) for th in table.iter("th")]


def test_html_escapes_values_and_headers():
    text = tables.format_table([{"a<b": "<script>x & y</script>"}])._repr_html_()
    assert "<script>" not in text and "a&lt;b" in text and "&lt;script&gt;x &amp; y&lt;/script&gt;" in text
    assert tables.format_table([])._repr_html_() == "<p>(no results)</p>"


def test_markdown():
    table = tables.format_table([{"impl": "a", "peer": "b|c", "ratio": 0.5}, {"impl": "d"}])
    assert table.markdown.splitlines() == ["| impl | peer | ratio |", "|---|---|---|", "| a | b\\|c | 0.5 |",
                                           "| d |  |  |"]
    assert tables.format_table([]).markdown == "(no results)"


def test_bad_width_and_rows():
    for width in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=rf"width={width!r} must be a positive int \(characters\)"):
            tables.format_table([{"a": 1}], width=width)
    with pytest.raises(ValueError, match=r"rows\[1\] has 1 values for 2 columns"):
        tables.Table(("a", "b"), (("1", "2"), ("3",)))
