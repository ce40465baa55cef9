"""Who may import whom in llmlab (README, "Layout"): the layers, the import graph read from the sources' AST,
and the problems with it — cycles, arrows pointing up, imports hidden inside functions without a reason.

`tests/test_layers.py` runs these on the project and on planted graphs (a cycle, an upward import), so the
checks themselves are known to fail when they should.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

# Lowest first. A module belongs to the longest prefix listed; an arrow may only point to its own layer or lower.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("llmlab", "llmlab.runtime", "llmlab.timing", "llmlab.invariants", "llmlab.tables", "llmlab.model",
              "llmlab.data", "llmlab.presets", "llmlab.validation", "llmlab.plots", "llmlab.timeline", "llmlab.flops",
              "llmlab.files", "llmlab.hardware.specs")),
    ("processes", ("llmlab.dist", "llmlab.dist.launcher", "llmlab.dist.grid", "llmlab.dist.collectives",
                   "llmlab.dist.commlog", "llmlab.dist.torchrun", "llmlab.dist._worker")),
    ("techniques", ("llmlab.parallel", "llmlab.memory", "llmlab.moe", "llmlab.moe_dispatch", "llmlab.moe_bench",
                    "llmlab.moe_balance", "llmlab.lora", "llmlab.quant", "llmlab.ptq", "llmlab.nf4", "llmlab.fp8",
                    "llmlab.precision", "llmlab.accumulate", "llmlab.sparsity", "llmlab.kernels",
                    "llmlab.dist.cost", "llmlab.dist.overlap", "llmlab.dist.allreduce_bench", "llmlab.dist.trace")),
    ("composed", ("llmlab.train", "llmlab.diagnose", "llmlab.hardware", "llmlab.monitor")),
    ("faces", ("llmlab.widgets", "llmlab.checks", "llmlab.claims", "llmlab.exercises")),
    ("commands", ("llmlab.cli", "llmlab.site", "llmlab.doctor", "llmlab.bench")),
)
LAYER_NAMES = tuple(name for name, _ in LAYERS)


def layer_of(module: str) -> str:
    """The layer of `module` (dotted name), by the longest prefix in LAYERS; KeyError when none fits."""
    best = None
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (name, len(prefix))
    if best is None:
        raise KeyError(f"{module} is in no layer: add it to tests/layering.py's LAYERS and the README's layout")
    return best[0]


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    imported: str  # dotted module name (resolved: `from llmlab import dist` imports llmlab.dist)
    path: Path
    line: int
    nested: bool  # inside a function or class body rather than at module level
    reason: str  # the comment on the import's line or the line above it ("" when none)
    internal: bool = True  # an llmlab module; False: another package's (torch, matplotlib, …)


def module_name(path: Path, roots: dict[str, Path]) -> str:
    """The dotted name of the module at `path`, given package roots {dotted prefix: folder}."""
    for prefix, root in sorted(roots.items(), key=lambda kv: -len(str(kv[1]))):
        try:
            rel = path.relative_to(root)
        except ValueError:
            continue
        parts = [prefix, *rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        return ".".join(parts)
    raise ValueError(f"{path} is under none of {roots}")


def _comment(lines: list[str], lineno: int) -> str:
    """The comment on line `lineno` (1-based) or, failing that, a whole-line comment just above it."""
    line = lines[lineno - 1]
    if "#" in line:
        return line.split("#", 1)[1].strip()
    above = lines[lineno - 2].strip() if lineno >= 2 else ""
    return above[1:].strip() if above.startswith("#") else ""


def read_imports(roots: dict[str, Path]) -> list[Import]:
    """Every import in the packages under `roots` ({"llmlab": Path("llmlab"), …}); `internal` marks those of
    the packages' own modules, which form the graph."""
    files = {module_name(p, roots): p for root in roots.values() for p in sorted(root.rglob("*.py"))}
    found = []
    for module, path in files.items():
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        tree = ast.parse(source, filename=str(path))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        nested_nodes = {id(n) for top in ast.walk(tree) if isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef
                                                                      | ast.ClassDef)
                        for n in ast.walk(top) if n is not top}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for target in dict.fromkeys(targets):
                named = target
                while target and target not in files and "." in target:
                    target = target.rpartition(".")[0]  # `import llmlab.dist.collectives as c` → its module
                if target != module:
                    found.append(Import(module, target if target in files else named, path, node.lineno,
                                        id(node) in nested_nodes, _comment(lines, node.lineno), target in files))
    return found


def cycles(imports: list[Import]) -> list[list[str]]:
    """The import cycles (each a list of modules, the first repeated at the end), one per strongly connected
    component with more than one module (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for imp in (i for i in imports if i.internal):
        graph.setdefault(imp.importer, set()).add(imp.imported)
        graph.setdefault(imp.imported, set())
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_path_through(sorted(component), graph))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _path_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One concrete cycle inside a strongly connected `component`, starting at its first module."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth-first, back to start
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    return [*component, start]


def upward(imports: list[Import]) -> list[str]:
    """Imports whose arrow points to a higher layer, as readable lines."""
    rank = {name: i for i, name in enumerate(LAYER_NAMES)}
    return [f"{imp.path}:{imp.line}: {imp.importer} ({layer_of(imp.importer)}) imports {imp.imported} "
            f"({layer_of(imp.imported)})" for imp in imports
            if imp.internal and rank[layer_of(imp.imported)] > rank[layer_of(imp.importer)]]


def unexplained_nested(imports: list[Import]) -> list[str]:
    """Imports inside a function or class with no comment saying why."""
    return [f"{imp.path}:{imp.line}: {imp.importer} imports {imp.imported} inside a function without a comment "
            "saying why (move it to the top, or say why on its line)" for imp in imports
            if imp.nested and not imp.reason]
