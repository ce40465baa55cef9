"""Training-state files: written atomically, refused with a clear message when truncated, corrupt or foreign.

Layout of a file: one header line, then the payload (a `torch.save` of a dict of tensors and plain values)::

    llmlab-train-state v1 <payload length in bytes> <sha256 of the payload, hex>\n<payload>

`write_state` writes to a temporary file in the same folder (`.NAME.PID.XXXX.tmp`, PID the writer's), flushes it
to disk and renames it over `path` (`os.replace` is atomic on POSIX and Windows), so a crash mid-write leaves the
old file intact, never a half-written one; the temporary files a killed writer left are removed by the next
write to the same path (those whose writer is no longer running). `read_state` checks the header, the length (a
truncated file is named as such) and the checksum before unpickling anything, and loads with `weights_only=True`
(no arbitrary code). `fsync_dir` flushes a folder's entries, for renames that must survive a power cut.

RNG states (`rng_state` / `set_rng_state`): torch's CPU generator, every CUDA device's when CUDA is
initialised, Python's `random` and NumPy's global generator, so dropout and anything else drawing random
numbers continue exactly as in an uninterrupted run.

`kill_point(phase)` is a test hook: when the environment variable LLMLAB_TEST_KILL_AT equals `phase`, the process
SIGKILLs itself there (tests/test_train_saves.py kills saves in each phase with it); unset, it does nothing.

Run the tests: `.venv/bin/pytest tests/test_train_trainer.py -k "save or resume or refuse"`.
"""

from __future__ import annotations

import glob
import hashlib
import io
import os
import random
import signal
import tempfile
from pathlib import Path

import numpy as np
import torch

from llmlab import runtime

__all__ = ["MAGIC", "VERSION", "KILL_ENV", "write_state", "read_state", "fsync_dir", "kill_point", "rng_state",
           "set_rng_state"]

MAGIC = "llmlab-train-state"
VERSION = 1
_MAX_HEADER = 256  # bytes: the header line is ~100
KILL_ENV = "LLMLAB_TEST_KILL_AT"


def kill_point(phase: str) -> None:
    """SIGKILL this process when the environment's LLMLAB_TEST_KILL_AT is `phase` (a test hook; else nothing)."""
    if os.environ.get(KILL_ENV) == phase:
        os.kill(os.getpid(), signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        pass
    return True


def _remove_stale_temporaries(path: Path) -> None:
    """Remove `.NAME.PID.XXXX.tmp` files a killed writer of `path` left (its PID no longer running)."""
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = tmp.name[len(path.name) + 2:].split(".")[0]
        if pid.isdigit() and not _running(int(pid)):
            tmp.unlink(missing_ok=True)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a folder's entries (the names created, renamed or removed in it) to disk, where the OS allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # Windows cannot open a folder; its renames are durable without this
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_state(path: str | os.PathLike, state: dict, kill_phase: str | None = None) -> Path:
    """Serialise `state` to `path` atomically (temporary file + fsync + rename); return the path. `kill_phase`:
    the `kill_point` between writing the temporary file and renaming it (tests kill a save there)."""
    path = Path(path)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    header = f"{MAGIC} v{VERSION} {len(payload)} {hashlib.sha256(payload).hexdigest()}\n".encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header + payload)
            f.flush()
            if kill_phase is not None:  # the bytes are in the temporary file, not yet renamed into place
                kill_point(kill_phase)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_state(path: str | os.PathLike) -> dict:
    """The dict `write_state` saved at `path`; ValueError naming the problem if the file is not intact."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path={str(path)!r}: no training-state file there")
    data = path.read_bytes()
    end = data.find(b"\n", 0, _MAX_HEADER)
    fields = data[:end].decode("ascii", "replace").split() if end >= 0 else []
    if len(fields) != 4 or fields[0] != MAGIC:
        raise ValueError(f"{path} is not an llmlab training-state file (no '{MAGIC}' header); "
                         "save one with Trainer.save")
    if fields[1] != f"v{VERSION}":
        raise ValueError(f"{path} has format {fields[1]}, this llmlab reads v{VERSION}")
    expected, payload = int(fields[2]), data[end + 1:]
    if len(payload) != expected:
        raise ValueError(f"{path} is truncated or padded: its header promises {expected} bytes of state, the file "
                         f"holds {len(payload)}; the save was interrupted or the file was cut, use an older one")
    if hashlib.sha256(payload).hexdigest() != fields[3]:
        raise ValueError(f"{path} is corrupt: its checksum does not match its contents")
    try:
        return torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as e:  # a payload written to pass the checks above, but not a torch.save of plain values
        raise ValueError(f"{path} holds a payload torch.load refuses ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''})") from e


def rng_state() -> dict:
    """Every random generator's state, in a form `torch.load(weights_only=True)` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return dict(torch=torch.get_rng_state(),
                cuda=runtime.cuda_rng_states(),
                python=random.getstate(),
                numpy=dict(kind=kind, keys=torch.from_numpy(keys.astype(np.int64)), pos=int(pos),
                           has_gauss=int(has_gauss), cached=float(cached)))


def set_rng_state(state: dict) -> None:
    """Restore `rng_state()`'s generators."""
    torch.set_rng_state(state["torch"])
    runtime.set_cuda_rng_states(state["cuda"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
