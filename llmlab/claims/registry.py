"""The claims registry: the reference table (llmlab/CLAIMS.md), a claim's Measurement, the Registry that runs
claims by id, and the table a chapter shows.

Nothing here measures anything: the measurement functions live in the chapter modules of this package
(`llmlab.claims.ch01` … `ch08`), and `llmlab.claims` holds the default registry they register with.
"""

from __future__ import annotations

import html
import inspect
import os
import re
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from llmlab import validation

__all__ = ["VERDICTS", "INCONCLUSIVE", "UNDECIDED", "REFERENCE_PATH", "ReferenceRow", "Measurement", "Claim", "Row",
           "ClaimsTable", "Registry", "load_reference"]

INCONCLUSIVE = "inconclusive here (busy machine)"  # a timed verdict whose rounds spread too wide to decide
UNDECIDED = "not conclusive here (the repeats disagree)"  # repeated runs (seeds) of a measurement point both ways
VERDICTS = ("holds", "holds with conditions", "wrong", "misleading", INCONCLUSIVE, UNDECIDED)

REFERENCE_PATH = Path(__file__).resolve().parent.parent / "CLAIMS.md"


# --- the reference: llmlab/CLAIMS.md -------------------------------------------------------------------------

@dataclass(frozen=True)
class ReferenceRow:
    """One row of the table in llmlab/CLAIMS.md."""

    id: str  # "C1"
    section: str  # the material's section, "1" or "2.3"
    says: str  # what the material says
    reference: str  # the published facts to compare with
    how: str  # how llmlab measures it

    @property
    def chapter(self) -> int:
        """The chapter that shows this claim: the material's top-level section (§2.3 → chapter 2)."""
        return int(self.section.split(".")[0])

    @property
    def number(self) -> int:
        """The claim's number, for sorting: C12 → 12."""
        return _claim_number(self.id)


def load_reference(path: str | os.PathLike | None = None) -> list[ReferenceRow]:
    """The claims table of `path` (default: the repo's llmlab/CLAIMS.md), one ReferenceRow per claim."""
    path = Path(path) if path is not None else REFERENCE_PATH
    if not path.is_file():
        raise FileNotFoundError(f"path={str(path)!r}: no claims file there (llmlab.claims reads the repo's "
                                "llmlab/CLAIMS.md; is this a clone of the repository?)")
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not re.match(r"\|\s*C\d+\s*\|", line):
            continue  # prose, the header, the |---| separator
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5:
            raise ValueError(f"{path}:{lineno}: a claim row needs 5 cells (id, §, says, reference, how), "
                             f"found {len(cells)}")
        rows.append(ReferenceRow(*cells))
    if not rows:
        raise ValueError(f"{path}: no claim rows (lines starting with '| C<n> |') found")
    return rows


# --- a claim and its measurement ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Measurement:
    """What a claim's function measured or computed, and the verdict it reached from that."""

    value: float | tuple[float, ...] | Mapping[str, float]  # the number(s) measured
    unit: str  # of `value`: "FLOP", "×", "GB", "s"…
    text: str  # the "measured here" cell: short, e.g. "6·N·D = 3.15e23 FLOP"
    device: str  # where: `claims.here()` for a measurement, "computed" for arithmetic
    verdict: str  # one of VERDICTS

    def __post_init__(self):
        try:
            self.numbers()
        except (TypeError, ValueError):
            raise ValueError(f"value={self.value!r} must be a number, a tuple of numbers, or a mapping of "
                             "names to numbers") from None
        validation.one_of("verdict", self.verdict, VERDICTS)
        if not self.text:
            raise ValueError("text must say what was measured here")

    def numbers(self) -> list[float]:
        """`value` flattened to a list of numbers."""
        values = self.value.values() if isinstance(self.value, Mapping) else (
            self.value if isinstance(self.value, tuple | list) else (self.value,))
        return [float(v) for v in values]


@dataclass(frozen=True)
class Claim:
    """A registered claim: its id, the chapter that shows it, its texts and the function measuring it."""

    id: str
    chapter: int
    says: str
    reference: str
    measure: Callable[[], Measurement]

    @property
    def origin(self) -> str:
        """Where the measure function is defined, "module.qualname" (for messages)."""
        return _origin(self.measure)


@dataclass(frozen=True)
class Row:
    """One line of a chapter's claims table; `measurement` is None when its function failed."""

    id: str
    says: str
    measured: str
    device: str
    verdict: str
    measurement: Measurement | None = None
    error: str | None = None  # the traceback, when the function raised


def _claim_number(claim_id: str) -> int:
    return int(claim_id[1:])


@dataclass(frozen=True)
class ClaimsTable:
    """A chapter's claims table: HTML in Jupyter, markdown as text."""

    chapter: int
    rows: tuple[Row, ...]

    HEADER = ("id", "the material says", "measured here (device)", "verdict")

    def _cells(self, row: Row) -> tuple[str, str, str, str]:
        measured = f"{row.measured} ({row.device})" if row.device else row.measured
        return row.id, row.says, measured, row.verdict

    def to_markdown(self) -> str:
        if not self.rows:
            return f"(no claims registered for chapter {self.chapter})"
        escape = lambda s: s.replace("|", "\\|").replace("\n", " ")
        lines = ["| " + " | ".join(self.HEADER) + " |", "|" + "---|" * len(self.HEADER)]
        lines += ["| " + " | ".join(map(escape, self._cells(r))) + " |" for r in self.rows]
        return "\n".join(lines)

    __str__ = to_markdown

    _COLOURS = {"holds": "#1a7f37", "holds with conditions": "#9a6700", "wrong": "#cf222e",
                "misleading": "#cf222e", INCONCLUSIVE: "#6e7781", UNDECIDED: "#6e7781", "error": "#6e7781"}

    def _repr_html_(self) -> str:
        if not self.rows:
            return f"<p><em>no claims registered for chapter {self.chapter}</em></p>"
        head = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in self.HEADER)
        body = []
        for r in self.rows:
            cid, says, measured, verdict = map(html.escape, self._cells(r))
            if r.error:
                measured += (f"<details><summary>traceback</summary><pre>{html.escape(r.error)}</pre>"
                             "</details>")
            colour = self._COLOURS[r.verdict]
            body.append(f"<tr><td>{cid}</td><td style='text-align:left'>{says}</td>"
                        f"<td style='text-align:left'>{measured}</td>"
                        f"<td style='color:{colour};font-weight:bold'>{verdict}</td></tr>")
        return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


# --- the registry ------------------------------------------------------------------------------------------

class Registry:
    """Claims by id, checked against the reference table (llmlab/CLAIMS.md unless `reference` is given)."""

    def __init__(self, reference: list[ReferenceRow] | None = None):
        self._reference = {r.id: r for r in reference} if reference is not None else None
        self._claims: dict[str, Claim] = {}

    @property
    def reference(self) -> dict[str, ReferenceRow]:
        if self._reference is None:  # read on first use, so importing llmlab.claims touches no file
            self._reference = {r.id: r for r in load_reference()}
        return self._reference

    def register(self, claim_id: str, *, chapter: int, says: str | None = None, reference: str | None = None):
        """Decorator: register the function as the measurement of claim `claim_id`, shown in `chapter`.

        `says` and `reference` default to the claim's text in the reference table. Registering an id twice
        is refused, except when a module is re-imported (the same function, by module and name, replaces
        the old one — `importlib.reload` in a notebook).
        """
        row = self.reference.get(claim_id)
        if row is None:
            raise ValueError(f"claim_id={claim_id!r} is not in llmlab/CLAIMS.md "
                             f"(known: {', '.join(sorted(self.reference, key=_claim_number))})")
        if chapter != row.chapter:
            raise ValueError(f"chapter={chapter!r}, but llmlab/CLAIMS.md puts {claim_id} in §{row.section}, "
                             f"which is chapter {row.chapter}")

        def decorator(fn):
            if not callable(fn):
                raise ValueError(f"@register({claim_id!r}) must decorate a function, got {type(fn).__name__}")
            try:
                inspect.signature(fn).bind()
            except TypeError as e:
                raise ValueError(f"the measure function of {claim_id} must take no arguments: {e}") from None
            old = self._claims.get(claim_id)
            if old is not None and _origin(old.measure) != _origin(fn):
                raise ValueError(f"claim {claim_id} is already registered by {_origin(old.measure)}; "
                                 f"{_origin(fn)} cannot register it again")
            self._claims[claim_id] = Claim(claim_id, chapter, says if says is not None else row.says,
                                           reference if reference is not None else row.reference, fn)
            return fn

        return decorator

    def get(self, claim_id: str) -> Claim:
        if claim_id not in self._claims:
            raise KeyError(f"claim {claim_id!r} is not registered (registered: {', '.join(self.ids())})")
        return self._claims[claim_id]

    def ids(self, chapter: int | None = None) -> list[str]:
        """Registered ids (of `chapter`, if given), in numeric order."""
        ids = [c.id for c in self._claims.values() if chapter is None or c.chapter == chapter]
        return sorted(ids, key=_claim_number)

    def run(self, claim_id: str) -> Row:
        """Run one claim's function; an exception becomes an "error: …" row instead of propagating."""
        claim = self.get(claim_id)
        try:
            m = claim.measure()
            if not isinstance(m, Measurement):
                raise TypeError(f"the measure function returned {type(m).__name__}, not a Measurement")
        except Exception as e:
            return Row(claim.id, claim.says, f"error: {type(e).__name__}: {e}", "", "error",
                       error=traceback.format_exc())
        return Row(claim.id, claim.says, m.text, m.device, m.verdict, measurement=m)

    def table(self, chapter: int) -> ClaimsTable:
        """Run every claim of `chapter` now and return the table of results."""
        validation.integer("chapter", chapter, low=1, hint="(a chapter number)")
        return ClaimsTable(chapter, tuple(self.run(cid) for cid in self.ids(chapter)))


def _origin(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"

