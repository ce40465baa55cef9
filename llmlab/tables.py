"""Tables of results: rows of dicts shown as plain text in a terminal, as HTML in JupyterLab and on the site.

    from llmlab import tables
    table = tables.format_table([{"size": 1024, "ms": 0.5}, {"size": 4096, "ms": 1.9}])
    table            # the last expression of a cell, or display(table): a real HTML table
    print(table)     # in a terminal: aligned plain text

Columns are the rows' keys in order of first appearance; floats show 3 significant digits (`cell`); a column of
numbers is right-aligned, any other left-aligned. The same `Table` gives the README's markdown (`markdown`).
"""

from __future__ import annotations

import functools
import html
import re
import textwrap
from dataclasses import dataclass

from llmlab import validation

__all__ = ["Table", "format_table", "cell"]

EMPTY = "(no results)"

_NUMBER = re.compile(r"[-+−]?[\d.]")


def cell(value) -> str:
    """One value as a table shows it: a float to 3 significant digits (in e-notation from 10⁴), else `str`."""
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)


@dataclass(frozen=True)
class Table:
    """Formatted cells under their column names: `str(table)` / `table.text` is plain text at most `width`
    characters wide where the headers allow it, `_repr_html_` an HTML table, `markdown` a markdown table."""

    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]  # one formatted value per column
    width: int = 110

    def __post_init__(self):
        validation.positive_int("width", self.width, hint="(characters)")
        for i, row in enumerate(self.rows):
            if len(row) != len(self.columns):
                raise ValueError(f"rows[{i}] has {len(row)} values for {len(self.columns)} columns")

    @functools.cached_property
    def right(self) -> tuple[bool, ...]:
        """Per column: True when every value is a number (or blank, or —), which then align right."""
        return tuple(all(r[i] in ("", "—") or _NUMBER.match(r[i]) for r in self.rows)
                     for i in range(len(self.columns)))

    @functools.cached_property
    def text(self) -> str:
        """Plain text: a header, a rule of dashes, one line per row, columns two spaces apart.

        Wider than `width` characters, the longest headers wrap onto more lines (at spaces, never inside a value
        or a word), shortest-loss first, until the table fits or no header can wrap further: a notebook's output
        or a page shows it unbroken instead of folding every row.
        """
        if not self.rows:
            return EMPTY
        columns, cells = self.columns, self.rows
        values = [max(len(r[i]) for r in cells) for i in range(len(columns))]
        widths = [max(len(c), v) for c, v in zip(columns, values, strict=True)]
        narrowest = [max(v, *(len(word) for word in c.split())) if c.split() else v
                     for c, v in zip(columns, values, strict=True)]
        for i in sorted(range(len(columns)), key=lambda i: narrowest[i] - widths[i]):  # most to gain first
            excess = sum(widths) + 2 * (len(widths) - 1) - self.width
            if excess <= 0:
                break
            widths[i] = max(narrowest[i], widths[i] - excess)
        headers = [textwrap.wrap(c, w, break_long_words=False) or [""]
                   for c, w in zip(columns, widths, strict=True)]
        depth = max(map(len, headers))
        headers = [[""] * (depth - len(h)) + h for h in headers]  # bottom-aligned, next to the rule
        line = lambda values: "  ".join(v.rjust(w) if r else v.ljust(w)
                                        for v, w, r in zip(values, widths, self.right, strict=True)).rstrip()
        return "\n".join([*(line([h[k] for h in headers]) for k in range(depth)), line(["-" * w for w in widths]),
                          *map(line, cells)])

    def __str__(self) -> str:
        return self.text

    __repr__ = __str__  # a Python prompt shows the table itself, as print does

    def _repr_html_(self) -> str:
        """An HTML table (JupyterLab and the site show it): one header row, numbers right, text left."""
        if not self.rows:
            return f"<p>{EMPTY}</p>"
        align = ["right" if r else "left" for r in self.right]
        row = lambda tag, values: "<tr>" + "".join(
            f'<{tag} style="text-align:{a}">{html.escape(v)}</{tag}>' for v, a in zip(values, align, strict=True)
        ) + "</tr>"
        body = "".join(row("td", r) for r in self.rows)
        return f"<table><thead>{row('th', self.columns)}</thead><tbody>{body}</tbody></table>"

    @property
    def markdown(self) -> str:
        """A markdown table (GitHub's): a header row, a rule, one line per row; `|` in a value is escaped."""
        if not self.rows:
            return EMPTY
        line = lambda values: "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"
        return "\n".join([line(self.columns), "|" + "---|" * len(self.columns), *map(line, self.rows)])


def format_table(rows: list[dict], width: int = 110) -> Table:
    """The `Table` of `rows` (dicts; a key missing from a row is a blank cell): text at most `width` wide."""
    columns = tuple(dict.fromkeys(key for row in rows for key in row))
    return Table(tuple(map(str, columns)), tuple(tuple(cell(row.get(c, "")) for c in columns) for row in rows), width)
