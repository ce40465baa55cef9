"""Troubleshooting (the material's §7, chapter 7): tools a person reaches for when training goes wrong.

- `llmlab.diagnose.oom`: will a configuration fit a memory budget (the planner of `llmlab.memory.planner`), and
  which remedy saves how much — checked under an enforced budget on the CPU, the real allocator on a GPU.
- `llmlab.diagnose.divergence`: the first module that produces NaN/inf, the LR range test (Smith 2017),
  overfitting one batch, and checks of the targets and of the loss function.
- `llmlab.diagnose.comm`: the share of a step spent communicating (`comm_share`, `comm_verdict`) and the straggler
  rank (`rank_timing`, `find_straggler`).
- `llmlab.diagnose.hang`: where every rank of a hung collective waits (`diagnose_hang`), and
  TORCH_DISTRIBUTED_DEBUG=DETAIL ranks that name a mismatched collective instead of hanging (`debug_detail`).

Import the one you need: `from llmlab.diagnose import oom, divergence, comm, hang`.
"""
