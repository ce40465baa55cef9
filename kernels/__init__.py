"""Triton kernels of llmlab (packaged as `llmlab.kernels`).

Every kernel file has the same parts, in this order: the `@triton.jit` kernel, its launcher (which checks
its arguments), a plain-PyTorch `reference`, and a `bench` entry for `llmlab bench`. `vector_add` is the
first one to read.

Triton decides when a kernel is *defined* (decorated) whether it will be compiled for a GPU or run by its
interpreter on the CPU (`TRITON_INTERPRET=1`). So the mode is chosen here, before any kernel module is
imported: interpreted on the CPU tier, compiled on a GPU.
"""

from llmlab import runtime

runtime.configure_triton()
