"""Triton kernels of llmlab (packaged as `llmlab.kernels`)."""
