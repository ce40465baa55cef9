"""The layering of llmlab (README, "Layout"): no import cycle, no arrow pointing up, every import at a module's
top unless a comment says why — checked on the project's sources, and shown to fail on planted problems."""

from pathlib import Path

import layering
import pytest

ROOT = Path(__file__).resolve().parent.parent
ROOTS = {"llmlab": ROOT / "llmlab", "llmlab.kernels": ROOT / "kernels"}


@pytest.fixture(scope="module")
def imports():
    return layering.read_imports(ROOTS)


def test_every_module_has_a_layer(imports):
    modules = {i.importer for i in imports} | {i.imported for i in imports if i.internal}
    unplaced = []
    for module in sorted(modules):
        try:
            layering.layer_of(module)
        except KeyError as e:
            unplaced.append(str(e))
    assert not unplaced, "\n".join(unplaced)


def test_no_import_cycle(imports):
    found = layering.cycles(imports)
    assert not found, "import cycles:\n" + "\n".join(" → ".join(c) for c in found)


def test_arrows_point_down(imports):
    found = layering.upward(imports)
    assert not found, "imports that point up a layer:\n" + "\n".join(found)


def test_imports_inside_functions_say_why(imports):
    found = layering.unexplained_nested(imports)
    assert not found, f"{len(found)} unexplained imports inside functions:\n" + "\n".join(found)


def _package(tmp_path, files: dict[str, str]) -> dict[str, Path]:
    for name, source in files.items():
        path = tmp_path / "llmlab" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return {"llmlab": tmp_path / "llmlab"}


def test_a_planted_cycle_is_found(tmp_path):
    roots = _package(tmp_path, {
        "__init__.py": "",
        "runtime.py": "from llmlab import timing\n",
        "timing.py": "import llmlab.tables\n",
        "tables.py": "def f():\n    from llmlab.runtime import x  # late, to dodge the cycle\n",
        "model.py": "from llmlab import runtime\n",
    })
    found = layering.cycles(layering.read_imports(roots))
    assert found == [["llmlab.runtime", "llmlab.timing", "llmlab.tables", "llmlab.runtime"]]


def test_a_planted_upward_import_is_found(tmp_path):
    roots = _package(tmp_path, {
        "__init__.py": "",
        "precision.py": "from llmlab import claims\n",
        "claims/__init__.py": "from . import ch02\n",
        "claims/ch02.py": "from llmlab import precision\n",
    })
    imports = layering.read_imports(roots)
    (problem,) = layering.upward(imports)
    assert "llmlab.precision (techniques) imports llmlab.claims (faces)" in problem
    # the relative import resolved to the chapter module, which imports down: that is allowed
    assert any(i.importer == "llmlab.claims" and i.imported == "llmlab.claims.ch02" for i in imports)
    assert layering.cycles(imports) == [["llmlab.claims", "llmlab.claims.ch02", "llmlab.precision",
                                         "llmlab.claims"]]


def test_a_nested_import_needs_a_reason(tmp_path):
    roots = _package(tmp_path, {
        "__init__.py": "",
        "cli.py": ("def main():\n"
                   "    import torch  # only for commands that train: `llmlab --help` stays fast\n"
                   "    import numpy\n"
                   "    # ipywidgets is optional\n"
                   "    import ipywidgets\n"),
    })
    (problem,) = layering.unexplained_nested(layering.read_imports(roots))
    assert "llmlab.cli imports numpy inside a function" in problem
