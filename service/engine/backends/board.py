"""Who may still add to a batch being gathered: per model, the requests decoding their images (or, under the process
backend, waiting in a worker's outbox) that a partial batch waits for, so that a lone client never pays the
queue delay (batching.py).

Each process that decodes keeps a *board*: one int32 count per model, in the order of the inference side's models.
An HTTP worker's lies in shared memory: the worker writes it (process.py says when) and the inference process
reads it, with no message. The thread backend's decode threads count on a board of the process's own. A batcher
reads the sum over every board of its graph's models.

One board goes the other way: the inference process's room in each model's GPU decoder queue (JPEG_ROOM), which it
writes as its queues change and every HTTP worker reads to route an upload to the GPU or the CPU (pipeline.py).
"""
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .arena import map_or_make, map_records

BOARD_SLOTS = 1024  # a worker's board: one count per model, with room for the models loaded after start-up
JPEG_ROOM = "jpeg-room"  # the inference process's board of its GPU decoders' room: its file in the runtime folder


class Board:
    """One process's counts, by model index."""

    def __init__(self, counts: np.ndarray, path: Path | None = None):
        self.counts, self.path = counts, path

    @classmethod
    def shared(cls, path: Path, create: bool = False) -> "Board":
        """A board in the file at `path` (made and zeroed with `create`: its writer's)."""
        return cls(map_records(path, np.dtype(np.int32), BOARD_SLOTS, create), path)

    @classmethod
    def lasting(cls, path: Path) -> "Board":
        """A board in the file at `path`, made where it is missing, else the one there (arena.map_or_make)."""
        return cls(map_or_make(path, np.dtype(np.int32), BOARD_SLOTS), path)

    def tell(self, index: int, count: int) -> None:
        self.counts[index] = count


class Boards:
    """The inference side's view: the boards of the HTTP workers that joined, and its own (its decode threads')."""

    def __init__(self):
        self.own = Board(np.zeros(BOARD_SLOTS, np.int32))
        self._boards = [self.own]

    def join(self, path: Path) -> Board:
        """A worker's board, read from now on."""
        board = Board.shared(path)
        self._boards.append(board)
        return board

    def leave(self, board: Board) -> None:
        self._boards.remove(board)

    @contextmanager
    def preparing(self, index: int) -> Iterator[None]:
        """Around a request's decode in this process, for model `index`."""
        if index >= len(self.own.counts):  # (the thread backend has no cap on its models)
            self.own.counts = np.concatenate([self.own.counts, np.zeros_like(self.own.counts)])
        self.own.counts[index] += 1
        try:
            yield
        finally:
            self.own.counts[index] -= 1

    def coming(self, models: Sequence[int]) -> int:
        """The requests on their way for these models, on every board."""
        return sum(int(board.counts[i]) for board in self._boards for i in models if i < len(board.counts))
