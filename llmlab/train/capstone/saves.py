"""The capstone's sharded checkpoint, and what may resume from it.

    DIR/step-N/rank{r}.pt     every rank's `Trainer.state_dict()` (its model part, its ZeRO shards) and the layout
    DIR/step-N/manifest.pt    written by rank 0 once every rank file is: the layout, the update count, the flags

How a checkpoint becomes current (an atomic rename of its folder, the K newest kept) is `checkpoints`'. Each file is
written atomically (llmlab.train.state). The layout is {world_size, dp, cp, tp, zero}: rank g is tensor-parallel
rank g % tp of context-parallel rank g // tp % cp of data-parallel replica g // (cp·tp) (llmlab.dist.Grid's).
Resuming on the same layout loads each rank's own file (bit-exact); on another data-parallel size, a data-parallel
rank loads a replica's file of its tensor- and context-parallel rank, and ZeRO re-shards every saved rank's
optimizer state (`ZeRO.load_state_dict` with the list of them).
Anything else (other --tp, --cp or --zero, other flags, a missing, truncated, forged or foreign file) is refused
with a ValueError naming both sides. Every field of a manifest is checked (type and value) before it is used. A save
from before --sp and --cp existed (no such flags, no cp in its layout) reads as --cp 1 without --sp: `ADDED`.

Test hook: LLMLAB_TEST_KILL_AT=PHASE:N SIGKILLs a rank in the save of update N at PHASE, one of `PHASES`
(llmlab.train.state.kill_point; tests/test_train_saves.py).
"""

from __future__ import annotations

import types
from dataclasses import fields
from pathlib import Path
from typing import get_type_hints

import torch.distributed as td

from llmlab.train import state as state_file
from llmlab.train.capstone import checkpoints
from llmlab.train.capstone.config import RunConfig, check

__all__ = ["PHASES", "describe", "read_manifest", "check_resume", "replaced", "save", "load"]

# where a save can be killed: writing a rank file, after the rank files (before the manifest), after the manifest
# (before the commit's rename), after the commit (before older checkpoints are pruned)
PHASES = ("rank-file", "before-manifest", "after-manifest", "after-commit")
_LAYOUT = ("world_size", "dp", "cp", "tp", "zero")
ADDED = {"sp": False, "cp": 1}  # flags (and the layout's cp) added after the first saves: what their absence meant


def describe(layout: dict) -> str:
    cp = f" × cp {layout['cp']}" if layout["cp"] > 1 else ""
    return f"world {layout['world_size']} = dp {layout['dp']}{cp} × tp {layout['tp']}, zero {layout['zero']}"


def _with_added(layout):
    """A saved layout, with cp = 1 where it predates --cp (anything but a dict is left to be refused)."""
    return {"cp": 1, **layout} if isinstance(layout, dict) else layout


def _typed(hint, value) -> bool:
    """Is `value` of the RunConfig field type `hint` (a bool is no int here)?"""
    allowed = hint.__args__ if isinstance(hint, types.UnionType) else (hint,)
    return bool in allowed if isinstance(value, bool) else any(isinstance(value, t) for t in allowed)


def _manifest_problem(manifest, folder: Path) -> str | None:
    """What is wrong with a manifest's fields (types, values, consistency), or None."""
    if not isinstance(manifest, dict) or set(manifest) != {"layout", "step", "flags"}:
        return f"keys {sorted(manifest) if isinstance(manifest, dict) else type(manifest).__name__}, expected " \
               "flags, layout, step"
    layout, step, flags = manifest["layout"], manifest["step"], manifest["flags"]
    if not (isinstance(layout, dict) and set(layout) == set(_LAYOUT)
            and all(type(layout[k]) is int and layout[k] >= (k != "zero") for k in _LAYOUT)):
        return f"layout {layout!r} is not {{world_size, dp, cp, tp, zero}} of positive ints"
    if layout["dp"] * layout["cp"] * layout["tp"] != layout["world_size"] or layout["zero"] > 3:
        return f"layout {layout!r} is impossible (world_size = dp × cp × tp, zero 0-3)"
    hints = get_type_hints(RunConfig)
    names = [f.name for f in fields(RunConfig) if f.metadata["training"]]
    if not isinstance(flags, dict) or set(flags) != set(names):
        return f"flags {sorted(flags) if isinstance(flags, dict) else type(flags).__name__}, expected {names}"
    wrong = [n for n in names if not _typed(hints[n], flags[n])]
    if wrong:
        return f"flag values of the wrong type: {', '.join(f'{n}={flags[n]!r}' for n in wrong)}"
    try:
        train = check(RunConfig(**flags), layout["world_size"])
    except ValueError as e:
        return f"its flags are refused: {e}"
    if (flags["tp"], flags["cp"], flags["zero"]) != (layout["tp"], layout["cp"], layout["zero"]):
        return f"flags --tp {flags['tp']} --cp {flags['cp']} --zero {flags['zero']} do not match layout " \
               f"{describe(layout)}"
    if type(step) is not int or not 0 <= step <= train.steps:
        return f"step {step!r} is not an update count from 0 to --steps {train.steps}"
    named = checkpoints.step_dir(folder.parent, step).name
    if folder.name.startswith("step-") and folder.name != named:
        return f"step {step} does not match the folder's name {folder.name}"
    return None


def read_manifest(path) -> dict:
    """The manifest of the checkpoint `path` means (see `checkpoints.resolve`), every field checked: ValueError
    when missing, truncated, forged or not a capstone save. Its folder is in `manifest["folder"]`."""
    folder = checkpoints.resolve(path)
    file = folder / checkpoints.MANIFEST
    manifest = state_file.read_state(file)
    if isinstance(manifest, dict) and isinstance(manifest.get("flags"), dict):
        manifest = dict(manifest, layout=_with_added(manifest.get("layout")), flags={**ADDED, **manifest["flags"]})
    problem = _manifest_problem(manifest, folder)
    if problem:
        raise ValueError(f"{file} is not a valid capstone manifest: {problem}")
    return dict(manifest, folder=folder)


def check_resume(manifest: dict, config: RunConfig, world_size: int, path) -> None:
    """Refuse (ValueError) resuming `manifest`'s save with other --tp/--cp/--zero (naming both layouts) or flags."""
    saved = manifest["layout"]
    here = dict(world_size=world_size, dp=world_size // (config.tp * config.cp), cp=config.cp, tp=config.tp,
                zero=config.zero)
    if any(saved[k] != here[k] for k in ("tp", "cp", "zero")):
        raise ValueError(f"--resume {path} holds layout {describe(saved)}; this run is {describe(here)}: only "
                         "the data-parallel size may change on resume (same --tp, --cp and --zero)")
    flags = config.flags()
    if manifest["flags"] != flags:
        diff = ", ".join(f"--{k.replace('_', '-')}: saved {v!r}, here {flags.get(k)!r}"
                         for k, v in manifest["flags"].items() if flags.get(k) != v)
        raise ValueError(f"--resume {path} was saved with other flags ({diff}); resume with the saved run's flags")


def replaced(root, config: RunConfig, start: int) -> list[Path]:
    """The checkpoints in `root` that a run of `config` starting at update `start` would replace: another run's
    (other flags, or a manifest that does not read) and this run's beyond `start`."""
    out = []
    for step, folder in checkpoints.checkpoints(root):
        try:
            other = read_manifest(folder)["flags"] != config.flags()
        except ValueError:
            other = True
        if other or step > start:
            out.append(folder)
    return out


def _barrier() -> None:
    if td.is_initialized():
        td.barrier()


def save(trainer, root) -> Path | None:
    """Save the capstone `trainer` as the checkpoint DIR/step-N of its update N (every rank calls it): every rank
    file, then the manifest, into DIR/.tmp-step-N, committed by renaming it; then the checkpoints it replaces
    (--overwrite) and those beyond --keep are removed. Returns the checkpoint, or None when DIR already holds this
    run's checkpoint of update N (a run resumed from it and saved again at once). OSError becomes a ValueError
    naming DIR and the update."""
    root, step, rank, run = Path(root), trainer.step_count, trainer.global_rank, trainer.run
    if trainer.replacing is None:  # decided once, at the run's first save, by every rank alike
        trainer.replacing = replaced(root, run, trainer.start_step) if run.overwrite else []
    final = checkpoints.step_dir(root, step)
    if final.exists() and final not in trainer.replacing:
        return None
    tmp = checkpoints.tmp_dir(root, step)
    try:
        if rank == 0:
            checkpoints.begin(root, step)
        _barrier()
        state_file.write_state(tmp / f"rank{rank}.pt", dict(trainer.state_dict(), layout=trainer.layout()),
                               kill_phase=f"rank-file:{step}")
        _barrier()
        if rank == 0:
            state_file.kill_point(f"before-manifest:{step}")
            state_file.write_state(tmp / checkpoints.MANIFEST, dict(layout=trainer.layout(), step=step,
                                                                   flags=run.flags()))
            state_file.kill_point(f"after-manifest:{step}")
            checkpoints.commit(tmp, step)
            state_file.kill_point(f"after-commit:{step}")
            checkpoints.prune(root, run.keep, remove=[p for p in trainer.replacing if p != final])
        trainer.replacing = []
        _barrier()
    except OSError as e:
        raise ValueError(f"--save {root}: writing the checkpoint of update {step} failed ({e}); the checkpoints "
                         "saved before it are intact") from e
    return final


def load(trainer, path) -> None:
    """Continue the capstone `trainer` from the checkpoint `path` means (see the module docstring and
    `checkpoints.resolve`). Every rank calls it."""
    manifest = read_manifest(path)
    folder, theirs, mine = manifest["folder"], manifest["layout"], trainer.layout()
    check_resume(manifest, trainer.run, mine["world_size"], folder)
    same, rank = theirs == mine, trainer.global_rank
    if same:
        ranks = [rank]
    elif trainer.zero is None:
        ranks = [rank % theirs["world_size"]]  # data parallel: every replica holds its tensor-parallel rank's state
    else:
        ranks = list(range(theirs["world_size"]))  # ZeRO: every saved shard, re-cut for this world
    states = [state_file.read_state(folder / f"rank{r}.pt") for r in ranks]
    for r, s in zip(ranks, states, strict=True):
        if not isinstance(s, dict) or _with_added(s.get("layout")) != theirs or s.get("step") != manifest["step"]:
            found = (s.get("layout"), s.get("step")) if isinstance(s, dict) else type(s).__name__
            raise ValueError(f"{folder}/rank{r}.pt ({found}) does not belong to the manifest's save (layout "
                             f"{theirs}, step {manifest['step']})")
    own = states[ranks.index(rank)] if rank in ranks else states[0]
    if trainer.zero is not None and not same:
        own = dict(own, optimizer=[s["optimizer"] for s in states])
    trainer.load_state_dict(own, source=folder)
    trainer.start_step = trainer.step_count

