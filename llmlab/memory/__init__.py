"""Memory optimisation (the material's §3, chapter 3): where the memory of a training step goes, and how
to make it smaller.

- `llmlab.memory.measure`: bytes of model state (parameters, gradients, optimizer state) and of the
  activations autograd saves for backward, counted exactly; the CUDA allocator's peak.
- `llmlab.memory.checkpoint`: activation checkpointing from scratch (Chen et al. 2016): keep a segment's
  input, recompute the rest in backward.
- `llmlab.memory.planner`: the memory model of a training configuration (ZeRO stage, data / tensor /
  pipeline degree, recompute: none, the attention core (selective) or every block), checked against `measure`
  and against the ZeRO and Korthikanti et al. papers' figures.
- `llmlab.memory.compress`: saved activations stored in 8 (or fewer) bits, dequantized for backward.

Import the one you need: `from llmlab.memory import measure, planner`.
"""
