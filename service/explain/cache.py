"""A bounded cache of attention results, by id: least recently used out first, by count and by bytes,
and nothing older than its time to live."""
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


@dataclass
class AttentionResult:
    """What a map needs, kept from the one decode of the upload: nothing is decoded again."""
    model: str
    attention: dict[str, np.ndarray]  # this image's rows of the attention outputs (copies, not batch views)
    image: np.ndarray  # the model's input, uint8 [H, W, 3]: rollout runs the explain graph on it
    # what a PNG is drawn over: the decoded photo (or face region), uint8 [h, w, 3]; or, where the request decoded
    # it reduced, the upload's own bytes, uint8 [n], decoded again at the PNG's size only when one is asked for
    photo: np.ndarray
    size: tuple[int, int]  # the (width, height) of the upload (or face region) the map is over
    created: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return self.image.nbytes + self.photo.nbytes + sum(a.nbytes for a in self.attention.values())


class AttentionCache:
    def __init__(self, max_items: int, max_bytes: int, ttl_s: float):
        self.max_items, self.max_bytes, self.ttl_s = max_items, max_bytes, ttl_s
        self._items: OrderedDict[str, AttentionResult] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, key: str, record: AttentionResult) -> bool:
        """Store a record; False when it alone is larger than the whole cache."""
        if record.nbytes > self.max_bytes:
            return False
        with self._lock:
            self._drop(key)
            self._items[key] = record
            self._bytes += record.nbytes
            while len(self._items) > self.max_items or self._bytes > self.max_bytes:
                self._drop(next(iter(self._items)))
        return True

    def get(self, key: str) -> AttentionResult | None:
        with self._lock:
            record = self._items.get(key)
            if record is None:
                return None
            if time.monotonic() - record.created > self.ttl_s:
                self._drop(key)
                return None
            self._items.move_to_end(key)
            return record

    def _drop(self, key: str) -> None:
        record = self._items.pop(key, None)
        if record is not None:
            self._bytes -= record.nbytes
