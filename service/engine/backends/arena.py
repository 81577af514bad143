"""Records in shared memory: one file per (worker, model, kind) in the service's runtime folder (/dev/shm),
mapped by the worker that decodes into it and by the inference process that batches from it and writes the
results back. Pages are touched only as slots are used, so the size is a ceiling, not an allocation."""
import mmap
import os
from pathlib import Path

import numpy as np


def map_records(path: Path, dtype: np.dtype, slots: int, create: bool = False) -> np.ndarray:
    """The file as an array of `slots` records (made, sized and zeroed with `create`)."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, slots * dtype.itemsize)
        buffer = mmap.mmap(fd, slots * dtype.itemsize)
    finally:
        os.close(fd)
    return np.ndarray(slots, dtype, buffer)


def map_or_make(path: Path, dtype: np.dtype, slots: int) -> np.ndarray:
    """`map_records` of the file made (zeroed) by whichever process opens it first: one that outlives the
    processes that write it (the heartbeat, the GPU decoders' room, which a restarted inference process rewrites
    and the workers keep mapped)."""
    try:
        return map_records(path, dtype, slots, create=True)
    except FileExistsError:
        return map_records(path, dtype, slots)


class Arena:
    """A worker's slots for one model and kind; a request takes a contiguous run of them."""

    def __init__(self, path: Path, dtype: np.dtype, slots: int):
        self.path, self.slots = path, slots
        self.records = map_records(path, dtype, slots, create=True)
        self._used = bytearray(slots)  # 1 where taken

    def take(self, n: int) -> int | None:
        """The first of n free contiguous slots, now taken; None when there is no such run."""
        start = self._used.find(bytes(n))
        if start < 0 or n > self.slots:
            return None
        self._used[start:start + n] = b"\1" * n
        return start

    def give_back(self, start: int, n: int) -> None:
        self._used[start:start + n] = bytes(n)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
