"""llmlab: a workbook for how large models are trained.

`import llmlab` is cheap (no torch, no Jupyter): submodules load on first use, e.g. `llmlab.runtime`.
It chooses Triton's mode first (`runtime.configure_triton`): interpreted on a machine without a GPU.
"""

import importlib

from llmlab import runtime as _runtime

__version__ = "0.1.0"

_runtime.configure_triton(probe_torch=False)  # before torch or anything else can import triton

def __getattr__(name):
    """`llmlab.widgets`, `llmlab.flops`, …: any submodule, imported on first use."""
    if name.startswith("_"):
        raise AttributeError(name)
    try:
        return importlib.import_module(f"llmlab.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"llmlab.{name}":
            raise
        raise AttributeError(f"module 'llmlab' has no attribute {name!r}") from None
