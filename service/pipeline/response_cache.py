"""Answers kept by what was asked: a repeated upload (a product photo, a thumbnail, a retried request) is answered
without a decode or a batch. Off unless VITSERVE_RESPONSE_CACHE_BYTES is set; each HTTP worker keeps its own.

The key is a hash of the whole upload (BLAKE2b, 32 bytes, its length beside it: never a truncated encoding of the
bytes, the bug others shipped) with the model version it ran on (its key and its load, so that a reload misses)
and every parameter that changes the answer (top_k). The value is the image's row of every result field, as the
run wrote it: the same answer, not the one next to it. Least recently used out first, by bytes.
"""
import hashlib
import threading
from collections import OrderedDict

import numpy as np

ENTRY_BYTES = 240  # what an entry costs beside its arrays: the key, the dict and the arrays' own headers


def upload_key(model_key: str, loads: int, top_k: int, upload: bytes) -> tuple:
    return model_key, loads, top_k, len(upload), hashlib.blake2b(upload, digest_size=32).digest()


class ResponseCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple, dict[str, np.ndarray]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # keys are hashed in the decode pool; gets and puts run on the event loop

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: tuple) -> dict[str, np.ndarray] | None:
        with self._lock:
            row = self._items.get(key)
            if row is not None:
                self._items.move_to_end(key)
            return row

    def put(self, key: tuple, row: dict[str, np.ndarray]) -> None:
        """Keep one image's result row (copies); the least recently used go while the whole is over its bytes."""
        size = _size(row)
        if size > self.max_bytes:
            return
        with self._lock:
            self._drop(key)
            self._items[key] = row
            self._bytes += size
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def forget(self, model_key: str) -> None:
        """Every answer of a model version (it reloaded: its keys would never be asked again)."""
        with self._lock:
            for key in [k for k in self._items if k[0] == model_key]:
                self._drop(key)

    def _drop(self, key: tuple) -> None:
        row = self._items.pop(key, None)
        if row is not None:
            self._bytes -= _size(row)


def _size(row: dict[str, np.ndarray]) -> int:
    return ENTRY_BYTES + sum(value.nbytes for value in row.values())
