"""What `llmlab train` checks before any rank starts and before the model is allocated, so that a run that cannot
finish fails in a second with one line, not after the training:

- memory: `llmlab.memory.planner`'s estimate per rank (model state under the run's ZeRO stage and tensor-parallel
  degree, the activations of one micro-batch) times the ranks sharing this machine's memory (CPU) or per GPU,
  against the memory there (`machine_memory`); refused when it cannot fit (`check_memory`);
- cores: more local ranks than cores is allowed, with a warning of the expected slowdown (`cores_warning`);
- the save directory (`check_save_dir`): not a file, writable (a probe file is created there), room on its disk
  for the checkpoints (`checkpoint_bytes`), and not holding other files, another run's checkpoints or this run's
  beyond where it starts, unless --overwrite.

    warnings = preflight.check(config, world=4, local_ranks=4, start=0)   # ValueError when the run cannot go
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from llmlab import runtime, timing
from llmlab.memory import planner
from llmlab.model import GPT, GPTConfig
from llmlab.train.capstone import checkpoints, saves
from llmlab.train.capstone.config import RunConfig
from llmlab.train.capstone.parts import compose_model

__all__ = ["check", "check_memory", "cores_warning", "machine_memory", "parameter_counts", "checkpoint_bytes",
           "check_save_dir"]

# A checkpoint's bytes beyond its tensors: each update's metrics in `history` (a dict of ~7 floats, ~0.3 kB pickled,
# measured: tests/test_train_saves.py compares the estimate with a real save) and per file the pickle's framing.
_HISTORY_BYTES, _FILE_BYTES = 400, 64 * 1024


def _size(n: float) -> str:
    """Bytes in powers of 1000, e.g. '2.6 TB'."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"


def machine_memory(gpu: bool) -> tuple[int | None, str]:
    """(bytes, whose): GPU 0's memory (`gpu`), else the host's (its cgroup's limit if lower); None where the OS
    does not say."""
    if gpu:
        props = runtime.device_properties(0)
        return props.total_memory, f"{props.name}'s"
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows)
        return None, "this machine's"
    limit = Path("/sys/fs/cgroup/memory.max")  # a container's limit (cgroup v2); "max" when there is none
    text = limit.read_text().strip() if limit.is_file() else ""
    return (min(total, int(text)) if text.isdigit() else total), "this machine's"


def check_memory(config: RunConfig, world: int, local_ranks: int) -> None:
    """ValueError when the planner's estimate for one rank exceeds a GPU's memory (a rank per GPU), or, on CPU
    (also when there are more local ranks than GPUs: they run on CPU), times the local ranks, the host's."""
    train = config.train_config()
    tp, dp = config.tp, world // config.tp
    half = train.precision in ("bf16", "fp16")
    gpu = runtime.tier().is_gpu and local_ranks <= runtime.device_count()
    plan = planner.plan(GPTConfig.preset(train.model, block_size=train.block_size), train.batch_size // dp,
                        stage=config.zero, data=dp, tensor=tp, checkpointing=config.checkpoint,
                        precision="fp32",  # the Trainer keeps fp32 weights, gradients and AdamW moments
                        dtype_bytes=2 if half else 4, mask_bytes=1 if gpu else (2 if half else 4))
    memory, whose = machine_memory(gpu)
    sharing = 1 if gpu else local_ranks
    if memory is None or plan.total * sharing <= memory:
        return
    parts = sorted(plan.breakdown().items(), key=lambda kv: -kv[1])[:2]
    raise ValueError(f"--batch-size {train.batch_size} --block-size {train.block_size} on {world} rank(s): "
                     f"llmlab.memory.planner estimates {_size(plan.total)} per rank ("
                     + ", ".join(f"{k} {_size(v)}" for k, v in parts) + ")"
                     + (f" × {sharing} ranks here" if sharing > 1 else "")
                     + f", more than {whose} {_size(memory)} of memory: lower --batch-size or --block-size, "
                       "add --checkpoint, or use more ranks")


def cores_warning(nproc: int) -> str | None:
    """A warning when `nproc` local ranks outnumber this process's cores (they time-share them), else None."""
    cores = timing.Load.now().cores
    if nproc <= cores:
        return None
    return (f"warning: --nproc {nproc} on {cores} core(s): the ranks take turns on the cores, so each update takes "
            f"about {nproc / cores:.0f}× as long as with one core per rank (--nproc {cores}); running anyway")


def parameter_counts(config: RunConfig) -> tuple[int, int]:
    """(parameters, trainable parameters) of the run's composed model, whole (tp 1), built on the meta device (no
    memory). Fake quantization's step sizes (one scalar per layer) are left out: --quant cannot build on meta."""
    train = config.train_config()
    with torch.device("meta"):
        model = compose_model(GPT(GPTConfig.preset(train.model, block_size=train.block_size)),
                              replace(config, tp=1, quant=None))
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def checkpoint_bytes(config: RunConfig, world: int) -> int:
    """Bytes of one checkpoint on disk, all ranks' files: fp32 weights (4 B each) and AdamW's two fp32 moments of
    the trainable ones (8 B), once per data-parallel replica (a replica's tensor-parallel ranks split one model);
    ZeRO keeps one copy of the trainable part in all (its shards: weights and moments, 12 B), the frozen part per
    replica. Plus each update's metrics in the history, on every rank."""
    total, trainable = parameter_counts(config)
    dp, steps = world // config.tp, config.train_config().steps
    if config.zero:
        tensors = 12 * trainable + dp * 4 * (total - trainable)
    else:
        tensors = dp * (4 * total + 8 * trainable)
    return tensors + world * (steps * _HISTORY_BYTES + _FILE_BYTES)


def check_save_dir(config: RunConfig, world: int, start: int) -> None:
    """ValueError (one line) when --save DIR cannot take this run's checkpoints; the run starts at update `start`.
    Creates DIR (it is written to at the first save anyway)."""
    root = Path(config.save)
    if root.exists() and not root.is_dir():
        raise ValueError(f"--save {root}: it is a file, not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".llmlab-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"--save {root}: cannot write there ({e.strerror or e})") from e
    end = config.stop_at or config.train_config().steps
    saves_ahead = 1 + ((end - start) // config.save_every if config.save_every else 0)
    each = checkpoint_bytes(config, world)
    need, free = each * min(saves_ahead, config.keep + 1), shutil.disk_usage(root).free
    if need > free:
        raise ValueError(f"--save {root}: {_size(free)} free on its disk, the checkpoints need about {_size(need)} "
                         f"({min(saves_ahead, config.keep + 1)} × {_size(each)}: the --keep {config.keep} kept and "
                         "the one being written); free some space, lower --keep or save elsewhere")
    if config.overwrite:
        return
    others = checkpoints.other_entries(root)
    if others:
        raise ValueError(f"--save {root}: it holds other files ({', '.join(others[:3])}"
                         + (", …" if len(others) > 3 else "") + "); save into a new or empty directory")
    theirs = saves.replaced(root, config, start)
    if theirs:
        newest = theirs[-1]
        try:
            other = saves.read_manifest(newest)["flags"] != config.flags()
        except ValueError as e:
            raise ValueError(f"--save {root}: it holds a checkpoint that does not read ({e}); "
                             "--overwrite replaces it") from e
        if other:
            raise ValueError(f"--save {root}: it holds another run's checkpoint ({newest.name}, saved with other "
                             "flags); save elsewhere, or --overwrite replaces it")
        raise ValueError(f"--save {root}: it holds this run's checkpoint of a later update ({newest.name}; this run "
                         f"starts at update {start}); --resume {root} continues it, --overwrite replaces it")


def check(config: RunConfig, world: int, local_ranks: int, start: int) -> list[str]:
    """Every check above for a run of `config` on `world` ranks, `local_ranks` of them on this machine, starting at
    update `start`: ValueError when it cannot run; the warnings to print when it can."""
    check_memory(config, world, local_ranks)
    if config.save:
        check_save_dir(config, world, start)
    warning = cores_warning(local_ranks)
    return [warning] if warning else []
