"""Checks for chapter 3's exercises (solutions/03_memory.ipynb), one module per exercise:

    from llmlab.checks import ch03 as check
    check.adamw_shard_step(adamw_shard_step)    # 3.1 ZeRO-1's sharded AdamW step, on 2, 3 and 4 gloo ranks (zero1)
    check.checkpoint(checkpoint)                # 3.2 activation checkpointing from scratch (checkpointing)
    check.pack_hooks(pack_8bit, unpack_8bit)    # 3.3 8-bit saved-tensor hooks (hooks8)
    check.close()                               # stop 3.1's ranks now (they also stop when Python exits)

3.1 runs on real ranks, on subgroups of one `llmlab.dist.Cluster(4)` (`_common`); 3.2 and 3.3 run here, on the CPU,
on blocks of the chapter's GPT with fresh random sizes.
"""

from __future__ import annotations

from llmlab.checks.ch03._common import WORLD_SIZES, close
from llmlab.checks.ch03.checkpointing import checkpoint
from llmlab.checks.ch03.hooks8 import GRAD_ERROR_FACTOR, MAX_BYTES_RATIO, pack_hooks, stored_bytes
from llmlab.checks.ch03.zero1 import adamw_shard_step

__all__ = ["adamw_shard_step", "checkpoint", "pack_hooks", "close", "WORLD_SIZES", "MAX_BYTES_RATIO",
           "GRAD_ERROR_FACTOR", "stored_bytes"]
