"""Widgets for the chapters: sliders in front of pure functions, so exploring is one drag away.

One module per chapter (`compute` for chapter 1, `parallelism` 2, `memory` 3, `communication` 4, …, `frontier` 8),
all built on `base.explorer`. Each widget wraps a pure function that computes everything it shows (tests call
those directly); the arithmetic is llmlab's own, these modules only arrange it. Everything is re-exported here:

    from llmlab import widgets
    widgets.training_time_calculator()       # the last line of a cell: the live widget
    widgets.training_estimate(175e9, 300e9, "A100 SXM", gpus=1000, mfu=0.4)["days"]

A widget is an `ipywidgets.VBox` whose display also carries its current result as static output: a plain-text
line (and a PNG of the plot) next to the widget view in the same output. JupyterLab shows the live widget; a
headless run, nbconvert or a rendered page without widget state shows the static result instead. ipywidgets and
IPython are imported only when a widget is built, never by `import llmlab`.
"""

from llmlab.widgets import communication, compute, frontier, hardware, memory, parallelism, tuning
from llmlab.widgets.communication import *  # noqa: F403
from llmlab.widgets.compute import *  # noqa: F403
from llmlab.widgets.frontier import *  # noqa: F403
from llmlab.widgets.hardware import *  # noqa: F403
from llmlab.widgets.memory import *  # noqa: F403
from llmlab.widgets.parallelism import *  # noqa: F403
from llmlab.widgets.tuning import *  # noqa: F403

# a chapter's module adds itself to this tuple and to the imports above
CHAPTERS = (compute, parallelism, memory, communication, hardware, tuning, frontier)
__all__ = [name for module in CHAPTERS for name in module.__all__]
