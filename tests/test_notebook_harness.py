"""The notebook harness works: pytest executes notebooks with nbval, a raising cell fails its notebook, the
wall-time section lists every notebook against its budget, and `gpu` tests skip on the CPU tier.

Runs pytest in a subprocess on a scratch project holding a copy of the root conftest.py, so what is checked is
the very configuration `pytest` from the repo root uses (plus pyproject's options, passed explicitly).
"""

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

from llmlab import runtime

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"
# loaded by path: other folders' conftest.py files (tests/browser/) also go by the module name "conftest"
_spec = importlib.util.spec_from_file_location("llmlab_root_conftest", CONFTEST)
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


def _notebook(path: Path, *sources: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb = new_notebook(cells=[new_code_cell(s) for s in sources], metadata={"kernelspec": kernelspec})
    nbformat.write(nb, path)


def test_pytest_runs_notebooks_fails_the_broken_one_and_prints_wall_times(tmp_path):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")
    _notebook(tmp_path / "chapters" / "01_good.ipynb", "x = 1 + 1", "from llmlab import runtime\nprint(x)")
    _notebook(tmp_path / "exercises" / "01_bad.ipynb", "y = 2", "raise ValueError('this cell is broken')")
    (tmp_path / "test_gpu_only.py").write_text(
        "import pytest\nimport torch\n\n\n@pytest.mark.gpu\ndef test_needs_gpu():\n"
        "    assert torch.cuda.is_available()\n")

    # -rA: a summary line per test, by node id ("PASSED chapters/01_good.ipynb::Cell 0").
    command = [sys.executable, "-m", "pytest", "-rA", "--nbval-lax", "-p", "no:cacheprovider", str(tmp_path)]
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 1, log  # 1: some tests failed (not 2-4: an error of pytest itself)

    for outcome in ("PASSED chapters/01_good.ipynb::Cell 0", "PASSED chapters/01_good.ipynb::Cell 1",
                    "PASSED exercises/01_bad.ipynb::Cell 0", "FAILED exercises/01_bad.ipynb::Cell 1"):
        assert outcome in log, f"no {outcome!r} in:\n{log}"
    assert "this cell is broken" in log

    section = log[log.index("notebook wall times"):]
    good = next(line for line in section.splitlines() if "chapters/01_good.ipynb" in line)
    bad = next(line for line in section.splitlines() if "exercises/01_bad.ipynb" in line)
    assert re.match(r"\s*\d+\.\d s  \(budget 60 s\)  ok\s+chapters/01_good.ipynb  \[2 cells\]$", good), good
    assert re.match(r"\s*\d+\.\d s  \(budget 40 s\)  ok\s+exercises/01_bad.ipynb  \[2 cells, 1 failed\]$",
                    bad), bad

    if not runtime.tier().is_gpu:
        assert re.search(r"SKIPPED \[1\] test_gpu_only.py:\d+: needs a CUDA GPU: this is the cpu tier", log)


def test_wall_time_lines_mark_over_budget_notebooks():
    times = {"chapters/01_compute.ipynb": 75.0, "solutions/03_memory.ipynb": 12.5,
             "exercises/03_memory.ipynb": 41.0, "tests/notebooks/harness_demo.ipynb": 3.0}
    cells = dict.fromkeys(times, 10)
    failed = dict.fromkeys(times, 0) | {"solutions/03_memory.ipynb": 2}
    lines = conftest.wall_time_lines(times, cells, failed)
    assert lines == [
        "   75.0 s  (budget 60 s)  OVER BUDGET  chapters/01_compute.ipynb  [10 cells]",
        "   41.0 s  (budget 40 s)  OVER BUDGET  exercises/03_memory.ipynb  [10 cells]",
        "   12.5 s  (budget 40 s)  ok           solutions/03_memory.ipynb  [10 cells, 2 failed]",
        "    3.0 s  (budget 60 s)  ok           tests/notebooks/harness_demo.ipynb  [10 cells]",
    ]
