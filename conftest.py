"""What every test run shares: notebook wall times against their budgets, and the `gpu` marker.

This file sits at the project root so that `pytest chapters/01_compute.ipynb` loads it too.

Notebooks (exercises/, solutions/, tests/notebooks/, and chapters/ when named: `pytest chapters/`) are executed
by nbval, one pytest item per cell; a plain `pytest` leaves chapters/ to `make site`, which CI runs next. The
terminal summary gets a section "notebook wall times" listing each notebook with its total seconds (kernel start,
every cell, shutdown) and its budget on a 2-core CPU (README, "Tests"): a chapter 60 s (as llmlab.site.BUDGET_S),
an exercise or solution notebook 40 s. An over-budget notebook is marked OVER BUDGET but does not fail the run:
wall time on a shared machine varies from run to run, and speed stays out of pass/fail (`llmlab bench` measures
speed). The section is there so a slow notebook is seen.

Notebooks run in the kernel of this very Python (nbval's --nbval-current-env), so they import the llmlab
installed here, whatever Jupyter kernels a user has registered elsewhere.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import PurePosixPath

import pytest

# first, whichever test file runs first: it makes Triton interpret kernels on the CPU tier before torch can import
# triton (tests/test_flops.py's FlopCounterMode does); see runtime.configure_triton
import llmlab  # noqa: F401

# chapters: a copy of llmlab.site.BUDGET_S, not imported from it (importing site loads nbconvert at every start)
BUDGETS_S = {"chapters": 60.0, "exercises": 40.0, "solutions": 40.0}
DEFAULT_BUDGET_S = 60.0  # any other notebook (tests/notebooks/) is held to a chapter's budget


def budget_for(path: str) -> float:
    """The wall-time budget of the notebook at `path` (relative to the project root), by its folder."""
    return next((BUDGETS_S[p] for p in PurePosixPath(path).parts if p in BUDGETS_S), DEFAULT_BUDGET_S)


def wall_time_lines(times: dict[str, float], cells: dict[str, int], failed: dict[str, int]) -> list[str]:
    """The lines of the "notebook wall times" section, slowest first."""
    lines = []
    for path in sorted(times, key=times.get, reverse=True):
        seconds, budget = times[path], budget_for(path)
        verdict = "OVER BUDGET" if seconds > budget else "ok"
        outcome = f"{cells[path]} cells" + (f", {failed[path]} failed" if failed[path] else "")
        lines.append(f"{seconds:7.1f} s  (budget {budget:.0f} s)  {verdict:<11}  {path}  [{outcome}]")
    return lines


class NotebookTimes:
    """Adds up each notebook's setup/call/teardown durations, report by report, and prints them at the end.

    A plugin object rather than conftest hooks, so that the hooks see every item, wherever it was collected.
    """

    def __init__(self):
        self.times: dict[str, float] = defaultdict(float)
        self.cells: dict[str, int] = defaultdict(int)
        self.failed: dict[str, int] = defaultdict(int)

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::", 1)[0]
        if not path.endswith(".ipynb"):
            return
        self.times[path] += report.duration
        if report.when == "call":
            self.cells[path] += 1
        if report.failed:
            self.failed[path] += 1

    def pytest_terminal_summary(self, terminalreporter):
        if not self.times:
            return
        over = sum(t > budget_for(p) for p, t in self.times.items())
        title = "notebook wall times" + (f" ({over} over budget)" if over else "")
        terminalreporter.section(title, yellow=bool(over), green=not over)
        for line in wall_time_lines(self.times, self.cells, self.failed):
            terminalreporter.write_line(line, yellow="OVER BUDGET" in line)


def pytest_configure(config):
    config.pluginmanager.register(NotebookTimes(), "llmlab-notebook-times")
    option = config.option
    if hasattr(option, "nbval_current_env") and not getattr(option, "nbval_kernel_name", None):
        option.nbval_current_env = True


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    from llmlab import runtime

    tier = runtime.tier()
    if tier.is_gpu and not getattr(tier, "smoke", False):
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: this is the cpu tier (no CUDA, or LLMLAB_DEVICE=cpu), or the "
                                   "GPU smoke mode, whose CPU stand-ins are not CUDA (LLMLAB_GPU_SMOKE=1)")
    for item in gpu_items:
        item.add_marker(skip)
