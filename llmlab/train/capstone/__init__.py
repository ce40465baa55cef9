"""The capstone: `llmlab train`, one command composing the workbook's parts by flags, on 1 to many ranks.

    llmlab train --preset tiny --steps 50                        # one CPU (or GPU) process
    llmlab train --nproc 4 --zero 2 --accum 2                    # 4 local gloo ranks (llmlab.dist.spawn)
    llmlab train --nproc 4 --tp 2 --checkpoint                   # 2 data-parallel × 2 tensor-parallel ranks
    llmlab train --nproc 2 --tp 2 --sp                           # and sequence parallel between the matmuls
    llmlab train --nproc 4 --cp 2                                # 2 data-parallel × 2 context-parallel ranks
    torchrun --nnodes 2 --nproc-per-node 8 -m llmlab.train --zero 1 --preset small   # NCCL; the env decides

(`python -m llmlab.train …` is the same command.) The world is dp × cp × tp ranks laid out by llmlab.dist.Grid:
rank g is tensor-parallel rank g % tp of context-parallel rank g // tp % cp of data-parallel replica g // (cp·tp).
What each flag composes, all from the library:

    (world size)   Trainer(data_parallel=True): llmlab.parallel.ddp.DataParallel over the dp ranks
    --zero S       llmlab.memory.zero.ZeRO stage S over the dp ranks (its own AdamW on shards)
    --tp N         llmlab.parallel.tensor.ParallelBlock for every block (Megatron attention + MLP)
    --sp           with --tp: llmlab.parallel.sequence (Megatron-SP), the blocks hold T/tp tokens between matmuls
    --cp N         llmlab.parallel.context: each sequence cut zig-zag over N ranks, ring attention in every block,
                   each rank's loss over its tokens, gradients averaged over the N (Capstone.clip)
    --checkpoint   llmlab.memory.checkpoint.checkpointed(blocks)      --compress8   compressed_activations(8)
    --precision    Trainer's autocast (+ dynamic loss scaling for fp16)  --accum N  Trainer's accumulation
    --lora R       llmlab.lora.apply_lora (attention, rank R)         --moe E   llmlab.moe.MoELayer MLPs (top-2)
    --quant        llmlab.quant.quantize_model: w8a8 (MinMax 8/8) or w4a8 (LSQ 4-bit weights, MinMax 8-bit inputs)

Combinations that do not compose are refused before any rank starts (`check`, the table `config.RULES`).
Gradient clipping is global over shards (`Capstone.clip`).

Checkpoints: `--save DIR` (every `--save-every N` updates and at the end) writes DIR/step-N/ — rank{r}.pt per rank,
then manifest.pt (layout, step, flags) — and makes it current by an atomic rename, so a crash never costs the
previous checkpoint; the `--keep K` newest stay. A DIR holding other files, another run, or this run further on is
refused unless `--overwrite`; so is a DIR that cannot be written or lacks room for the checkpoints, before training.
`--resume DIR` continues bit-exactly from the newest complete checkpoint on the same layout, and re-shards
data-parallel and ZeRO states onto another data-parallel size. `--stop-at K` stops (and saves) after update K.

Errors: `--timeout T` fails a run in which no update finished for T seconds (every rank's stack in a file), whatever
its length. Every error a user can cause is one line on stderr and exit code 2; sizes that cannot fit in memory
(llmlab.memory.planner's estimate) are refused before anything is allocated; more ranks than cores run, warned.

The parts: `config` (RunConfig: the flags, their defaults and help; the composition rules), `parts` (model
surgery, ZeRO as the Trainer's optimizer, which gradients are shards), `composed` (the Capstone trainer),
`saves` (one sharded checkpoint and what may resume from it), `checkpoints` (the save directory: step folders,
commit, keep), `preflight` (memory, cores, the save directory, before any rank starts), `hang` (the hang detector
of a process alone), `launch` (one process, local ranks or torchrun).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from llmlab.dist import RankError, RankHang
from llmlab.train.capstone.composed import Capstone
from llmlab.train.capstone.config import RULES, RunConfig, add_flags, check
from llmlab.train.capstone.launch import launch, run_rank

__all__ = ["RunConfig", "RULES", "Capstone", "check", "run_rank", "launch", "build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad flag refused in one line (argparse prints the usage first) and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (flags: {self.prog} --help)\n")


def build_parser(prog: str = "python -m llmlab.train") -> argparse.ArgumentParser:
    """The command line: one flag per RunConfig field; this docstring's examples as the epilog of --help."""
    parser = _Parser(prog=prog, description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    return add_flags(parser)


def _one_line(error: Exception) -> str:
    """The error as one line: a launcher error's headline, or the message; more lines (every rank's stack, a
    traceback) go to a file the line names."""
    text = str(error).strip() or type(error).__name__
    line = getattr(error, "headline", None) or text.splitlines()[0]
    if text == line:
        return line
    fd, path = tempfile.mkstemp(prefix="llmlab-train-error-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    return f"{line} (the full report, with every rank's stack: {path})"


def main(argv: list[str] | None = None, prog: str = "python -m llmlab.train") -> int:
    """Run the command; an error a user can cause (bad flags, a save that cannot be resumed or written, a size that
    cannot fit, a rank that failed, crashed or hung) is one line on stderr and exit code 2."""
    config = RunConfig.from_args(build_parser(prog).parse_args(argv))
    try:
        launch(config, prog=prog)
    except (ValueError, FileNotFoundError, RankError, RankHang) as e:
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    return 0
