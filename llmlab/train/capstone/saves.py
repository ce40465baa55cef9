"""The capstone's sharded save folder, and what may resume from it.

    DIR/rank{r}.pt     every rank's `Trainer.state_dict()` (its model part, its ZeRO shards) and the layout
    DIR/manifest.pt    written by rank 0 once every rank file is: the layout, the update count, the flags

Each file is written atomically (llmlab.train.state). The layout is {world_size, dp, tp, zero}: rank g is
tensor-parallel rank g % tp of data-parallel replica g // tp (llmlab.dist.Grid's). Resuming on the same layout
loads each rank's own file (bit-exact); on another data-parallel size, a data-parallel rank loads a replica's
file of its tensor-parallel rank, and ZeRO re-shards every saved rank's optimizer state
(`ZeRO.load_state_dict` with the list of them). Anything else (other --tp or --zero, other flags, a missing,
truncated or foreign file) is refused with a ValueError naming both sides.
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as td

from llmlab.train import state as state_file
from llmlab.train.capstone.config import RunConfig

__all__ = ["describe", "read_manifest", "check_resume", "save", "load"]


def describe(layout: dict) -> str:
    return f"world {layout['world_size']} = dp {layout['dp']} × tp {layout['tp']}, zero {layout['zero']}"


def read_manifest(path) -> dict:
    """DIR/manifest.pt, checked (ValueError when missing, truncated or not a capstone save)."""
    file = Path(path) / "manifest.pt"
    if not file.is_file():
        raise ValueError(f"--resume {path}: no manifest.pt there (not a finished `llmlab train --save` folder)")
    manifest = state_file.read_state(file)
    if not {"layout", "step", "flags"} <= set(manifest):
        raise ValueError(f"{file} is not a capstone manifest (keys {sorted(manifest)})")
    return manifest


def check_resume(manifest: dict, config: RunConfig, world_size: int, path) -> None:
    """Refuse (ValueError) resuming `manifest`'s save with other --tp/--zero (naming both layouts) or flags."""
    saved = manifest["layout"]
    here = dict(world_size=world_size, dp=world_size // config.tp, tp=config.tp, zero=config.zero)
    if (saved["tp"], saved["zero"]) != (here["tp"], here["zero"]):
        raise ValueError(f"--resume {path} holds layout {describe(saved)}; this run is {describe(here)}: only "
                         "the data-parallel size may change on resume (same --tp and --zero)")
    flags = config.flags()
    if manifest["flags"] != flags:
        diff = ", ".join(f"--{k.replace('_', '-')}: saved {v!r}, here {flags.get(k)!r}"
                         for k, v in manifest["flags"].items() if flags.get(k) != v)
        raise ValueError(f"--resume {path} was saved with other flags ({diff}); resume with the saved run's flags")


def _barrier() -> None:
    if td.is_initialized():
        td.barrier()


def save(trainer, path) -> None:
    """Write DIR/rank{r}.pt on every rank of the capstone `trainer`, then (rank 0, once all are written)
    DIR/manifest.pt. Every rank calls it."""
    path = Path(path)
    state_file.write_state(path / f"rank{trainer.global_rank}.pt", dict(trainer.state_dict(), layout=trainer.layout()))
    _barrier()
    if trainer.global_rank == 0:
        state_file.write_state(path / "manifest.pt", dict(layout=trainer.layout(), step=trainer.step_count,
                                                          flags=trainer.run.flags()))
    _barrier()


def load(trainer, path) -> None:
    """Continue the capstone `trainer` from `save(path)` (see the module docstring). Every rank calls it."""
    path = Path(path)
    manifest = read_manifest(path)
    theirs, mine = manifest["layout"], trainer.layout()
    check_resume(manifest, trainer.run, mine["world_size"], path)
    same, rank = theirs == mine, trainer.global_rank
    if same:
        ranks = [rank]
    elif trainer.zero is None:
        ranks = [rank % theirs["world_size"]]  # data parallel: every replica holds its tensor-parallel rank's state
    else:
        ranks = list(range(theirs["world_size"]))  # ZeRO: every saved shard, re-cut for this world
    states = [state_file.read_state(path / f"rank{r}.pt") for r in ranks]
    for r, s in zip(ranks, states, strict=True):
        if s.get("layout") != theirs or s.get("step") != manifest["step"]:
            raise ValueError(f"{path}/rank{r}.pt (layout {s.get('layout')}, step {s.get('step')}) does not "
                             f"belong to the manifest's save (layout {theirs}, step {manifest['step']})")
    own = states[ranks.index(rank)] if rank in ranks else states[0]
    if trainer.zero is not None and not same:
        own = dict(own, optimizer=[s["optimizer"] for s in states])
    trainer.load_state_dict(own, source=path)
