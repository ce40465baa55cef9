"""The capstone: `llmlab train`, one command composing the workbook's parts by flags, on 1 to many ranks.

    llmlab train --preset tiny --steps 50                        # one CPU (or GPU) process
    llmlab train --nproc 4 --zero 2 --accum 2                    # 4 local gloo ranks (llmlab.dist.spawn)
    llmlab train --nproc 4 --tp 2 --checkpoint                   # 2 data-parallel × 2 tensor-parallel ranks
    torchrun --nnodes 2 --nproc-per-node 8 -m llmlab.train --zero 1 --preset small   # NCCL; the env decides

(`python -m llmlab.train …` is the same command.) The world is dp × tp ranks laid out by llmlab.dist.Grid: rank g
is tensor-parallel rank g % tp of data-parallel replica g // tp. What each flag composes, all from the library:

    (world size)   Trainer(data_parallel=True): llmlab.parallel.ddp.DataParallel over the dp ranks
    --zero S       llmlab.memory.zero.ZeRO stage S over the dp ranks (its own AdamW on shards)
    --tp N         llmlab.parallel.tensor.ParallelBlock for every block (Megatron attention + MLP)
    --checkpoint   llmlab.memory.checkpoint.checkpointed(blocks)      --compress8   compressed_activations(8)
    --precision    Trainer's autocast (+ dynamic loss scaling for fp16)  --accum N  Trainer's accumulation
    --lora R       llmlab.lora.apply_lora (attention, rank R)         --moe E   llmlab.moe.MoELayer MLPs (top-2)
    --quant        llmlab.quant.quantize_model: w8a8 (MinMax 8/8) or w4a8 (LSQ 4-bit weights, MinMax 8-bit inputs)

Combinations that do not compose are refused before any rank starts (`check`, the table `config.RULES`).
Gradient clipping is global over shards (`Capstone.clip`). `--save DIR` writes DIR/rank{r}.pt per rank and
DIR/manifest.pt (layout, step, flags), atomically (llmlab.train.state); `--resume DIR` continues bit-exactly on
the same layout, and re-shards data-parallel and ZeRO states onto another data-parallel size. `--stop-at K`
stops (and saves) after update K.

The parts: `config` (RunConfig: the flags, their defaults and help; the composition rules), `parts` (model
surgery, ZeRO as the Trainer's optimizer, which gradients are shards), `composed` (the Capstone trainer),
`saves` (the sharded save folder and what may resume from it), `launch` (one process, local ranks or torchrun).
"""

from __future__ import annotations

import argparse
import sys

from llmlab.dist import RankError
from llmlab.train.capstone.composed import Capstone
from llmlab.train.capstone.config import RULES, RunConfig, add_flags, check
from llmlab.train.capstone.launch import launch, run_rank

__all__ = ["RunConfig", "RULES", "Capstone", "check", "run_rank", "launch", "build_parser", "main"]


def build_parser(prog: str = "python -m llmlab.train") -> argparse.ArgumentParser:
    """The command line: one flag per RunConfig field; this docstring's examples as the epilog of --help."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    return add_flags(parser)


def main(argv: list[str] | None = None, prog: str = "python -m llmlab.train") -> int:
    config = RunConfig.from_args(build_parser(prog).parse_args(argv))
    try:
        launch(config)
    except (ValueError, FileNotFoundError, RankError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0
