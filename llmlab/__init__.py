"""llmlab: a workbook for how large models are trained.

`import llmlab` is cheap (no torch, no Jupyter): submodules load on first use, e.g. `llmlab.runtime`.
"""

import importlib

__version__ = "0.1.0"

_SUBMODULES = {"runtime", "dist", "model", "data", "exercises", "claims", "hardware", "doctor", "kernels"}


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"llmlab.{name}")
    raise AttributeError(f"module 'llmlab' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | _SUBMODULES)
