"""The capstone's save directory: one step directory per checkpoint, made current by an atomic rename.

    DIR/step-000006/         a complete checkpoint of update 6: rank{r}.pt for every rank and manifest.pt (`saves`)
    DIR/step-000004/         the one before it (--keep K: the K newest stay)
    DIR/.tmp-step-000008/    a save in progress, or one a crash interrupted: never read

A save (`saves.save`) writes every rank's file and then the manifest into DIR/.tmp-step-N/, each flushed to disk
(llmlab.train.state), flushes that folder, and renames it to DIR/step-N (`commit`). The rename is atomic: a crash
at any moment leaves the new checkpoint either complete or absent, and the previous complete one untouched. Only
then are the checkpoints beyond the K newest removed (`prune`). A step directory exists only complete, so the
newest one is the one to resume (`resolve`); folders of interrupted saves are ignored by a resume (`interrupted`
names them) and removed by the next save into DIR (`begin`).

`torch.distributed.checkpoint` (DCP) is not used: see README's capstone section for what it does and does not give.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from llmlab.train import state as state_file

__all__ = ["MANIFEST", "step_dir", "tmp_dir", "checkpoints", "interrupted", "other_entries", "resolve", "begin",
           "commit", "prune"]

MANIFEST = "manifest.pt"
_STEP = re.compile(r"step-(\d{6,})")
_TMP = re.compile(r"\.tmp-step-(\d{6,})")


def step_dir(root, step: int) -> Path:
    """DIR/step-N of update `step` (six digits at least, so that names sort as numbers do)."""
    return Path(root) / f"step-{step:06d}"


def tmp_dir(root, step: int) -> Path:
    """DIR/.tmp-step-N: where the save of update `step` is written before its commit."""
    return Path(root) / f".tmp-step-{step:06d}"


def checkpoints(root) -> list[tuple[int, Path]]:
    """The complete checkpoints in `root`, oldest first: (update, DIR/step-N)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.fullmatch(p.name)) and p.is_dir()]
    return sorted(found)


def interrupted(root) -> list[Path]:
    """The folders of saves into `root` that a crash interrupted (or that are in progress)."""
    root = Path(root)
    return sorted(p for p in root.iterdir() if _TMP.fullmatch(p.name)) if root.is_dir() else []


def other_entries(root) -> list[str]:
    """Names in `root` that are neither checkpoints nor interrupted saves (files a --save must leave alone)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if not (_STEP.fullmatch(p.name) or _TMP.fullmatch(p.name)))


def resolve(path) -> Path:
    """The checkpoint `--resume path` means: `path` itself when it holds a manifest (DIR/step-N, or a folder of the
    one-save layout), else the newest complete checkpoint in it. ValueError when there is none."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    found = checkpoints(path)
    if found:
        return found[-1][1]
    if not path.is_dir():
        raise ValueError(f"--resume {path}: no such directory")
    broken = interrupted(path)
    raise ValueError(f"--resume {path}: no complete checkpoint there (no step-N folder with a {MANIFEST})"
                     + (f"; {len(broken)} interrupted save(s), e.g. {broken[-1].name}" if broken else ""))


def begin(root, step: int) -> Path:
    """A fresh, empty DIR/.tmp-step-N for the save of update `step`, the folders of interrupted saves in DIR
    removed first (only one run saves into a DIR — `preflight.check_save_dir` — so none is in progress)."""
    for path in interrupted(root):
        shutil.rmtree(path)
    tmp = tmp_dir(root, step)
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, step: int) -> Path:
    """Make the complete save folder `tmp` the checkpoint DIR/step-N: flush its entries, rename it (atomic),
    flush DIR's. A checkpoint of that update already there (one being replaced) is removed first."""
    final = step_dir(tmp.parent, step)
    state_file.fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    state_file.fsync_dir(tmp.parent)
    return final


def prune(root, keep: int, remove=()) -> list[Path]:
    """Remove the checkpoints in `remove` and all but the `keep` newest in `root`; return what was removed."""
    remove = {Path(p) for p in remove}
    kept = [p for _, p in checkpoints(root) if p not in remove]
    gone = sorted(p for p in remove if p.exists()) + kept[:-keep]
    for path in gone:
        shutil.rmtree(path)
    state_file.fsync_dir(root)
    return gone
