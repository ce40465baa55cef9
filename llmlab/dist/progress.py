"""A rank's progress, seen by the caller: `heartbeat()` on a rank says "a step finished".

    def train(steps):
        for step in range(steps):
            ...                               # one training step
            dist.heartbeat()                  # a store to shared memory: no system call, no message

    dist.spawn(train, 4, 10_000, timeout=None, stall_timeout=600)   # RankHang if a rank stalls for 600 s

The launcher gives every rank an 8-byte slot in a shared counter file (`Counters`: unlinked, so nothing is left on
disk whatever happens, and mapped into memory by the caller and by every rank). `heartbeat()` adds one to this
rank's counter; the caller reads the counters while it waits for a call and raises `RankHang` when some rank
neither returned nor moved its counter for `stall_timeout` seconds. Outside a spawned rank (in the caller, under
torchrun) `heartbeat()` does nothing, so training code calls it unconditionally.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile

__all__ = ["heartbeat", "Counters"]

_SLOT = struct.Struct("Q")  # one unsigned 64-bit counter per rank
_mine: tuple[mmap.mmap, int] | None = None  # on a spawned rank: the shared map and this rank's offset in it


def heartbeat() -> None:
    """Report that this rank made progress (a step finished). A no-op outside a rank started by llmlab.dist."""
    if _mine is not None:
        counters, offset = _mine
        _SLOT.pack_into(counters, offset, _SLOT.unpack_from(counters, offset)[0] + 1)


def attach(fd: int, rank: int) -> None:
    """On a rank (called by the worker at start): map the caller's counter file, open as `fd`, for `heartbeat`."""
    global _mine
    _mine = (mmap.mmap(fd, 0), rank * _SLOT.size)  # mmap keeps its own reference to the file
    os.close(fd)


class Counters:
    """The caller's side: one counter per rank in an unlinked file whose descriptor (`fd`) the ranks inherit."""

    def __init__(self, world_size: int):
        self._file = tempfile.TemporaryFile()  # unlinked at once: nothing stays on disk after a kill
        os.ftruncate(self._file.fileno(), world_size * _SLOT.size)
        self._map = mmap.mmap(self._file.fileno(), 0)
        self.world_size = world_size

    @property
    def fd(self) -> int:
        return self._file.fileno()

    def read(self) -> list[int]:
        return [_SLOT.unpack_from(self._map, r * _SLOT.size)[0] for r in range(self.world_size)]

    def close(self) -> None:
        self._map.close()
        self._file.close()
