"""The course material's numeric claims, each measured or computed here, with a verdict.

The material says things like "mixed precision gives 3× speed" or "GPT-3 needs 3.14×10²³ FLOPs". Some hold,
some hold only under conditions, some are wrong. `llmlab/CLAIMS.md` lists them (C1…C21) with the published
facts to compare with. The library module that implements a claim's topic registers a function measuring it:

    from llmlab import claims, flops

    @claims.register("C1", chapter=1)          # says= and reference= default to llmlab/CLAIMS.md's text
    def gpt3_training_flops() -> claims.Measurement:
        total = flops.training_flops(175e9, 300e9)
        return claims.Measurement(
            value=total, unit="FLOP", text=f"6·N·D = {total:.3g} FLOP", device="computed",
            verdict="holds" if abs(total / 3.14e23 - 1) < 0.01 else "wrong")

and the module's name is added to `CLAIM_MODULES`, so `load_all()` finds it. Each chapter ends with
`claims.table(chapter)`: it runs the chapter's functions now and shows *the material says / measured here
(device) / verdict*. Nothing in that table is typed in: the verdict is decided by the function, from what it
measured. `coverage_problems(chapters_dir)` is what the tests use to prove every claim of every chapter
present is registered and really computed.
"""

from __future__ import annotations

import html
import importlib
import inspect
import os
import re
import sys
import traceback
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "VERDICTS", "CLAIM_MODULES", "REFERENCE_PATH", "ReferenceRow", "Measurement", "Claim", "Row",
    "ClaimsTable", "Registry", "REGISTRY", "load_reference", "register", "get", "table", "load_all", "here",
    "chapter_notebooks", "llmlab_references", "audit", "chapter_problems", "coverage_problems",
]

VERDICTS = ("holds", "holds with conditions", "wrong", "misleading")

# The library modules that register claims; a chapter's module adds its name here (e.g. "llmlab.flops").
CLAIM_MODULES: tuple[str, ...] = ("llmlab.flops", "llmlab.sparsity", "llmlab.hardware.roofline",
                                   "llmlab.precision", "llmlab.parallel.data", "llmlab.parallel.tensor",
                                   "llmlab.lora", "llmlab.moe", "llmlab.quant",
                                   "llmlab.memory.checkpoint", "llmlab.memory.planner", "llmlab.memory.compress",
                                   "llmlab.dist.bench", "llmlab.accumulate", "llmlab.dist.cost",
                                   "llmlab.hardware.material", "llmlab.train.schedule", "llmlab.train.clip",
                                   "llmlab.diagnose.oom")

REFERENCE_PATH = Path(__file__).resolve().parent / "CLAIMS.md"


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
        if self.verdict not in VERDICTS:
            raise ValueError(f"verdict={self.verdict!r} must be one of {VERDICTS}")
        if not self.text:
            raise ValueError("text must say what was measured here")

    def numbers(self) -> list[float]:
        """`value` flattened to a list of numbers."""
        values = self.value.values() if isinstance(self.value, Mapping) else (
            self.value if isinstance(self.value, tuple | list) else (self.value,))
        return [float(v) for v in values]


@dataclass(frozen=True)
class Claim:
    id: str
    chapter: int
    says: str
    reference: str
    measure: Callable[[], Measurement]


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
                "misleading": "#cf222e", "error": "#6e7781"}

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
        if isinstance(chapter, bool) or not isinstance(chapter, int) or chapter < 1:
            raise ValueError(f"chapter={chapter!r} must be a chapter number (1, 2, …)")
        return ClaimsTable(chapter, tuple(self.run(cid) for cid in self.ids(chapter)))


def _origin(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


REGISTRY = Registry()
register = REGISTRY.register
get = REGISTRY.get


def load_all() -> None:
    """Import every module in CLAIM_MODULES, so that all their claims are registered."""
    for name in CLAIM_MODULES:
        importlib.import_module(name)


def table(chapter: int) -> ClaimsTable:
    """The claims table of `chapter`, measured now (the last cell of every chapter)."""
    load_all()
    return REGISTRY.table(chapter)


def here() -> str:
    """Where a measurement ran, for `Measurement.device`: e.g. "cpu: AMD EPYC" or "cuda:0: NVIDIA H200"."""
    from llmlab import hardware, runtime

    device = runtime.device()
    return f"{device}: {hardware.device_name(device)}"


# --- coverage: is every claim of every chapter registered, and really measured? ----------------------------

def chapter_notebooks(chapters_dir: str | os.PathLike) -> dict[int, Path]:
    """The chapter notebooks in `chapters_dir` by chapter number: `03_memory.ipynb` is chapter 3."""
    found = {}
    for path in sorted(Path(chapters_dir).glob("[0-9][0-9]_*.ipynb")):
        found[int(path.name[:2])] = path
    return found


# Modules whose use does not make a function a computation of its claim: the registry itself, and the
# runtime, which says where code runs, not what it computes.
_NOT_A_COMPUTATION = ("llmlab.claims", "llmlab.runtime")


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)  # lambdas, comprehensions, nested functions


def _is_library(obj) -> bool:
    """Is `obj` an llmlab module, or a function or class defined in one, other than _NOT_A_COMPUTATION?"""
    if isinstance(obj, types.ModuleType):
        module = obj.__name__
    elif inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj) or inspect.ismethod(obj):
        module = getattr(obj, "__module__", None) or ""
    else:
        return False
    return (module == "llmlab" or module.startswith("llmlab.")) and module not in _NOT_A_COMPUTATION


def llmlab_references(fn) -> list[str]:
    """The llmlab modules, functions and classes `fn`'s code refers to (by global, closure or import name)."""
    fn = inspect.unwrap(fn)
    scope = {**fn.__globals__, **inspect.getclosurevars(fn).nonlocals}
    found = set()
    for code in _code_objects(fn.__code__):
        for name in (*code.co_names, *code.co_freevars):
            for obj in (scope.get(name), sys.modules.get(name), sys.modules.get(f"llmlab.{name}")):
                if _is_library(obj):
                    found.add(obj.__name__ if isinstance(obj, types.ModuleType)
                              else f"{obj.__module__}.{obj.__qualname__}")
    return sorted(found)


def _literals(fn) -> set[float]:
    """The numbers written in `fn`'s source (its code objects' constants), except 0 and ±1: any code has
    those (indices, signs), so a measured 0 or 1 cannot tell typed from computed."""
    numbers = set()
    for code in _code_objects(inspect.unwrap(fn).__code__):
        for const in code.co_consts:
            items = const if isinstance(const, tuple) else (const,)
            numbers.update(float(c) for c in items if isinstance(c, int | float) and not isinstance(c, bool))
    return numbers - {0.0, 1.0, -1.0}


def audit(claim: Claim) -> list[str]:
    """Problems showing `claim`'s function is not a real computation: it refers to no llmlab library code,
    it fails or returns something other than a Measurement, or its value is a number typed in its source."""
    problems = []
    origin = _origin(claim.measure)
    if not llmlab_references(claim.measure):
        problems.append(f"{claim.id}: {origin} refers to no llmlab library code (a function or module other "
                        f"than {' and '.join(_NOT_A_COMPUTATION)}); it must compute the claim")
    try:
        m = claim.measure()
    except Exception as e:
        return [*problems, f"{claim.id}: {origin} raised {type(e).__name__}: {e}"]
    if not isinstance(m, Measurement):
        return [*problems, f"{claim.id}: {origin} returned {type(m).__name__}, not a Measurement"]
    typed = [v for v in m.numbers() if v in _literals(claim.measure)]
    if typed:
        problems.append(f"{claim.id}: the measured value(s) {typed} are typed in {origin}'s source; compute "
                        "them with llmlab code (reference figures belong in the library)")
    return problems


def chapter_problems(chapter: int, registry: Registry | None = None) -> list[str]:
    """Problems with the claims of `chapter`: each claim the reference table puts in that chapter must be
    registered (the default registry after `load_all()`) and pass `audit`."""
    if registry is None:
        load_all()
        registry = REGISTRY
    problems = []
    for row in sorted(registry.reference.values(), key=lambda r: _claim_number(r.id)):
        if row.chapter != chapter:
            continue
        if row.id not in registry.ids():
            problems.append(f"{row.id} (§{row.section}, chapter {chapter}) is not registered: "
                            f"the material says {row.says!r}")
            continue
        problems += audit(registry.get(row.id))
    return problems


def coverage_problems(chapters_dir: str | os.PathLike, registry: Registry | None = None) -> list[str]:
    """`chapter_problems` of every chapter notebook in `chapters_dir`; empty when all is measured."""
    return [p for chapter in chapter_notebooks(chapters_dir) for p in chapter_problems(chapter, registry)]
