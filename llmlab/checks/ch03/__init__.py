"""Checks for chapter 3's exercises (solutions/03_memory.ipynb), one module per exercise:

    from llmlab.checks import ch03 as check
    check.zero1_step(zero1_step)                # 3.1 a whole ZeRO-1 step, on 1, 2, 3 and 4 gloo ranks (zero1)
    check.checkpoint(checkpoint)                # 3.2 activation checkpointing as an autograd.Function (checkpointing)
    check.pack_hooks(pack_8bit, unpack_8bit)    # 3.3 8-bit saved-tensor hooks (hooks8)
    check.flash_forward(flash_forward)          # 3.4 the online-softmax attention forward, tiled (flash)
    check.close()                               # stop 3.1's ranks now (they also stop when Python exits)

3.1 runs on real ranks, on subgroups of one `llmlab.dist.Cluster(4)` (`_common`); 3.2 and 3.3 run here, on the CPU,
on random blocks and blocks of the chapter's GPT with fresh random sizes; 3.4 here too, on random float64 q, k, v,
watching every tensor the answer creates (a TorchDispatchMode) and the FLOPs of its matmuls.
"""

from __future__ import annotations

from llmlab.checks.ch03._common import WORLD_SIZES, close
from llmlab.checks.ch03.checkpointing import checkpoint
from llmlab.checks.ch03.flash import flash_forward
from llmlab.checks.ch03.hooks8 import GRAD_ERROR_FACTOR, MAX_BYTES_RATIO, pack_hooks, stored_bytes
from llmlab.checks.ch03.zero1 import zero1_step

__all__ = ["zero1_step", "checkpoint", "pack_hooks", "flash_forward", "close", "WORLD_SIZES", "MAX_BYTES_RATIO",
           "GRAD_ERROR_FACTOR", "stored_bytes"]
