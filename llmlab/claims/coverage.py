"""Is every claim of every chapter registered, and really computed? The audit behind the coverage tests.

A measure function passes `audit` when it refers to llmlab library code (directly, or through a helper of its
chapter module), returns a Measurement, and its value is not a number typed in its source.
`registry_problems(registry, chapter)` applies it to every claim the reference table puts in a chapter;
`llmlab.claims.chapter_problems` and `coverage_problems` run it on the default registry.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import types
from pathlib import Path

from llmlab.claims.registry import Claim, Measurement, Registry

__all__ = ["chapter_notebooks", "llmlab_references", "audit", "registry_problems"]


def chapter_notebooks(chapters_dir: str | os.PathLike) -> dict[int, Path]:
    """The chapter notebooks in `chapters_dir` by chapter number: `03_memory.ipynb` is chapter 3."""
    found = {}
    for path in sorted(Path(chapters_dir).glob("[0-9][0-9]_*.ipynb")):
        found[int(path.name[:2])] = path
    return found


# Modules whose use does not make a function a computation of its claim: the claims package itself, and the
# runtime, which says where code runs, not what it computes. A helper function of a chapter module
# (llmlab.claims.ch01 …) is followed instead: what it refers to counts for the claim that calls it.
_NOT_A_COMPUTATION = ("llmlab.claims", "llmlab.runtime")
_CHAPTER_MODULE = re.compile(r"llmlab\.claims\.ch\d\d")


def _module_of(obj) -> str | None:
    """The module `obj` is, or is defined in, when it is a module, function or class; else None."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    if inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj) or inspect.ismethod(obj):
        return getattr(obj, "__module__", None) or ""
    return None


def _is_library(module: str) -> bool:
    """Is `module` llmlab library code, other than _NOT_A_COMPUTATION (and the modules inside them)?"""
    if module != "llmlab" and not module.startswith("llmlab."):
        return False
    return not any(module == m or module.startswith(m + ".") for m in _NOT_A_COMPUTATION)


def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)  # lambdas, comprehensions, nested functions


def _referenced(fn):
    """The objects `fn`'s code names (by global, closure or import name)."""
    scope = {**fn.__globals__, **inspect.getclosurevars(fn).nonlocals}
    for code in _code_objects(fn.__code__):
        for name in (*code.co_names, *code.co_freevars):
            yield from (scope.get(name), sys.modules.get(name), sys.modules.get(f"llmlab.{name}"))


def llmlab_references(fn) -> list[str]:
    """The llmlab modules, functions and classes `fn`'s code refers to (by global, closure or import name),
    and those its chapter module's helper functions refer to."""
    found, followed, todo = set(), set(), [inspect.unwrap(fn)]
    while todo:
        current = todo.pop()
        if current in followed:
            continue
        followed.add(current)
        for obj in _referenced(current):
            module = _module_of(obj)
            if module is None:
                continue
            if inspect.isfunction(obj) and _CHAPTER_MODULE.fullmatch(module):
                todo.append(inspect.unwrap(obj))
            elif _is_library(module):
                found.add(module if isinstance(obj, types.ModuleType) else f"{module}.{obj.__qualname__}")
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
    if not llmlab_references(claim.measure):
        problems.append(f"{claim.id}: {claim.origin} refers to no llmlab library code (a function or module other "
                        f"than {' and '.join(_NOT_A_COMPUTATION)}); it must compute the claim")
    try:
        m = claim.measure()
    except Exception as e:
        return [*problems, f"{claim.id}: {claim.origin} raised {type(e).__name__}: {e}"]
    if not isinstance(m, Measurement):
        return [*problems, f"{claim.id}: {claim.origin} returned {type(m).__name__}, not a Measurement"]
    typed = [v for v in m.numbers() if v in _literals(claim.measure)]
    if typed:
        problems.append(f"{claim.id}: the measured value(s) {typed} are typed in {claim.origin}'s source; compute "
                        "them with llmlab code (reference figures belong in the library)")
    return problems


def registry_problems(registry: Registry, chapter: int) -> list[str]:
    """Problems with the claims of `chapter` in `registry`: each claim the reference table puts in that chapter
    must be registered and pass `audit`."""
    problems = []
    for row in sorted(registry.reference.values(), key=lambda r: r.number):
        if row.chapter != chapter:
            continue
        if row.id not in registry.ids():
            problems.append(f"{row.id} (§{row.section}, chapter {chapter}) is not registered: "
                            f"the material says {row.says!r}")
            continue
        problems += audit(registry.get(row.id))
    return problems
