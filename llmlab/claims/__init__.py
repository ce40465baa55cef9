"""The course material's numeric claims, each measured or computed here, with a verdict.

The material says things like "mixed precision gives 3× speed" or "GPT-3 needs 3.14×10²³ FLOPs". Some hold,
some hold only under conditions, some are wrong. `llmlab/CLAIMS.md` lists them (C1…C21) with the published
facts to compare with. Each chapter's claims are measured by the functions of its module in this package,
`llmlab/claims/ch01.py` … `ch08.py`, which call the library's public API:

    from llmlab import flops
    from llmlab.claims import Measurement, register

    @register("C1", chapter=1)                 # says= and reference= default to llmlab/CLAIMS.md's text
    def gpt3_training_flops() -> Measurement:
        total = flops.training_flops(175e9, 300e9)
        return Measurement(
            value=total, unit="FLOP", text=f"6·N·D = {total:.3g} FLOP", device="computed",
            verdict="holds" if abs(total / 3.14e23 - 1) < 0.01 else "wrong")

`load_all()` imports every chapter module it finds in the package. Each chapter ends with
`claims.table(chapter)`: it runs the chapter's functions now and shows *the material says / measured here
(device) / verdict*. Nothing in that table is typed in: the verdict is decided by the function, from what it
measured. `coverage_problems(chapters_dir)` is what the tests use to prove every claim of every chapter
present is registered and really computed.

The registry and the table are in `llmlab.claims.registry`, the audit in `llmlab.claims.coverage`; their public
names are all here.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re

from llmlab import hardware, runtime
from llmlab.claims.coverage import audit, chapter_notebooks, llmlab_references, registry_problems
from llmlab.claims.registry import (
    INCONCLUSIVE,
    REFERENCE_PATH,
    UNDECIDED,
    VERDICTS,
    Claim,
    ClaimsTable,
    Measurement,
    ReferenceRow,
    Registry,
    Row,
    load_reference,
)

__all__ = [
    "VERDICTS", "INCONCLUSIVE", "UNDECIDED", "REFERENCE_PATH", "ReferenceRow", "Measurement", "Claim", "Row",
    "ClaimsTable", "Registry", "REGISTRY", "load_reference", "register", "get", "chapter_modules", "load_all", "table",
    "here", "chapter_notebooks", "llmlab_references", "audit", "registry_problems", "chapter_problems",
    "coverage_problems",
]

REGISTRY = Registry()
register = REGISTRY.register
get = REGISTRY.get


def chapter_modules() -> list[str]:
    """The chapter modules of this package, found on disk: ["llmlab.claims.ch01", …], in chapter order."""
    names = (m.name for m in pkgutil.iter_modules(__path__) if re.fullmatch(r"ch\d\d", m.name))
    return [f"{__name__}.{name}" for name in sorted(names)]


def load_all() -> None:
    """Import every chapter module (`chapter_modules()`), so that all their claims are registered."""
    for name in chapter_modules():
        importlib.import_module(name)


def table(chapter: int) -> ClaimsTable:
    """The claims table of `chapter`, measured now (the last cell of every chapter)."""
    load_all()
    return REGISTRY.table(chapter)


def here() -> str:
    """Where a measurement ran, for `Measurement.device`: e.g. "cpu: AMD EPYC" or "cuda:0: NVIDIA H200"."""
    device = runtime.device()
    return f"{device}: {hardware.device_name(device)}"


def chapter_problems(chapter: int, registry: Registry | None = None) -> list[str]:
    """Problems with the claims of `chapter` (`registry_problems`): each claim the reference table puts in that
    chapter must be registered in `registry` (the default registry after `load_all()`) and pass `audit`."""
    if registry is None:
        load_all()
        registry = REGISTRY
    return registry_problems(registry, chapter)


def coverage_problems(chapters_dir: str | os.PathLike, registry: Registry | None = None) -> list[str]:
    """`chapter_problems` of every chapter notebook in `chapters_dir`; empty when all is measured."""
    return [p for chapter in chapter_notebooks(chapters_dir) for p in chapter_problems(chapter, registry)]
