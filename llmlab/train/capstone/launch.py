"""Starting the capstone: `launch` checks the flags, the checkpoint to resume and the machine (`preflight`), then
runs on this process alone, on `nproc` local ranks (llmlab.dist.spawn), or inside torchrun's group; `run_rank` is
what each rank runs (its Grid, the Capstone, resume, fit, save) and returns a summary of.

--timeout T is a hang detector, not a limit on the run: spawned ranks call `dist.heartbeat()` after each update and
the launcher raises RankHang when one has not for T seconds (`spawn(..., timeout=None, stall_timeout=T)`); a process
alone (or a torchrun rank) is watched by `hang.Watchdog`."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace

import torch.distributed as td

from llmlab import dist
from llmlab.train.capstone import checkpoints, preflight, saves
from llmlab.train.capstone.composed import Capstone
from llmlab.train.capstone.config import RunConfig, check
from llmlab.train.capstone.hang import Watchdog

__all__ = ["run_rank", "launch"]


class _PrintLoss:
    """Monitor: one line per update on global rank 0."""

    def __init__(self, rank: int):
        self.rank = rank

    def log(self, step, metrics):
        if self.rank == 0:
            print(f"step {step:5d}  loss {metrics['loss']:.4f}  lr {metrics['lr']:.2e}  "
                  f"grad_norm {metrics['grad_norm']:.3f}  {metrics['tokens_per_s']:.0f} tok/s", flush=True)


def run_rank(config: RunConfig, quiet: bool = False, heartbeat=dist.heartbeat) -> dict:
    """Train per `config` on this rank (alone, or inside an initialised process group); return a summary.
    `heartbeat()` is called after each update (the hang detector's)."""
    grid = (dist.Grid(dp=td.get_world_size() // (config.tp * config.cp), cp=config.cp, tp=config.tp)
            if td.is_initialized() else None)
    rank = td.get_rank() if grid is not None else 0
    start = time.perf_counter()
    trainer = Capstone(config, grid, monitor=None if quiet else _PrintLoss(rank), heartbeat=heartbeat)
    if config.resume:
        trainer.load_state(config.resume)
    end = config.stop_at if config.stop_at is not None else trainer.config.steps
    trainer.fit(max(end - trainer.step_count, 0))
    if config.save and trainer.saved_step != trainer.step_count:
        trainer.save(config.save)
    summary = dict(rank=rank, layout=trainer.layout(), steps=trainer.step_count,
                   losses=[h["loss"] for h in trainer.history], grad_norms=[h["grad_norm"] for h in trainer.history],
                   params_here=sum(p.numel() for p in trainer.params), seconds=time.perf_counter() - start)
    if rank == 0 and not quiet:
        final = summary["losses"][-1] if summary["losses"] else float("nan")
        parts = [saves.describe(summary["layout"]), f"precision {trainer.config.precision}", f"accum {config.accum}"]
        parts += [f"{name} {getattr(config, name)}" for name in ("lora", "moe", "quant") if getattr(config, name)]
        parts += [name for name in ("checkpoint", "compress8") if getattr(config, name)]
        print(f"final loss {final:.4f} after {trainer.step_count} updates | {', '.join(parts)} | "
              f"{summary['params_here']} trainable parameters on rank 0 | {summary['seconds']:.1f} s"
              + (f" | saved to {config.save}" if config.save else ""), flush=True)
    return summary


def _alone(config: RunConfig, quiet: bool, prog: str) -> dict:
    with Watchdog(config.timeout, prog) as beat:
        return run_rank(config, quiet, heartbeat=beat)


def launch(config: RunConfig, quiet: bool = False, prog: str = "python -m llmlab.train") -> list[dict]:
    """Check, then run: under torchrun (RANK set) join its group; else `nproc` local ranks (spawn) or this process.
    Everything a user can get wrong is refused (ValueError) before any rank starts; warnings go to stderr. `prog`
    names the command in the hang detector's error line."""
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun and config.nproc != 1:
        raise ValueError(f"--nproc {config.nproc} under torchrun: torchrun already decides the ranks")
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else config.nproc
    speaks = not under_torchrun or os.environ["RANK"] == "0"
    check(config, world)
    start = 0
    if config.resume:  # a missing, truncated, forged or foreign save is refused before any rank starts
        manifest = saves.read_manifest(config.resume)
        saves.check_resume(manifest, config, world, manifest["folder"])
        for folder in checkpoints.interrupted(config.resume) if speaks else ():
            print(f"note: ignoring {folder}, a save that did not complete (the next save into that directory "
                  "removes it)", file=sys.stderr)
        start, config = manifest["step"], replace(config, resume=str(manifest["folder"]))  # every rank: this one
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if under_torchrun else config.nproc
    for warning in preflight.check(config, world, local, start):
        if speaks:
            print(warning, file=sys.stderr, flush=True)
    if under_torchrun:
        dist.init_from_env()
        return [_alone(config, quiet, prog)]
    if config.nproc == 1:
        return [_alone(config, quiet, prog)]
    return dist.spawn(run_rank, config.nproc, config, quiet, timeout=None, stall_timeout=config.timeout)
