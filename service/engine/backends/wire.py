"""Messages between HTTP workers and the inference process, over a Unix socket.

A message is a JSON header and, after it, the raw bytes of any arrays it carries (their names, dtypes and shapes
are in the header): no pickle, so nothing but plain data crosses. Image records do not travel here at all:
they live in shared memory (arena.py), and a message only says where: a worker's frame of requests is one
header and three small arrays (each request's first slot, its slot count and its top-k), whatever their number.
"""
import asyncio
import json
import math
import struct
from enum import StrEnum

import numpy as np

from service.explain.cache import AttentionResult

_SIZES = struct.Struct("<II")  # header bytes, array bytes


class Op(StrEnum):
    """Every message's "op", by who sends it (docs/serving.md draws a request's messages).

    The inference process sends, unasked:
      HELLO   on connecting: the models, their status and the problems found loading them
      STATUS  models loaded, reloaded or unloaded: the models and their status, with a generation number
      TAKEN   a frame's requests are all in batches that started: the worker's next frame for that model may go
      DONE    a frame's batches have ended: its results are in the records, with the requests that failed (by
              their place in the frame) and their errors
    A worker sends, unanswered:
      BOARD   once, after HELLO: the shared-memory file where it counts its requests still decoding, per model
      SEEN    the status generation it now routes by (an unload waits for every worker's)
      RUN     a frame: requests whose images are in its arena, as each one's first slot, slot count and top-k
              (and their priority level, and their traceparents where traces are on)
      CANCEL  a request of a frame (by its place in it) given up (client gone, timeout): its slots leave the
              queue
    A worker asks, and the reply carries the same "id" (and "error" where it failed):
      EXPLAIN, SIDE (a side graph's items: side_graphs.py), LOAD, UNLOAD, INDEX,
      STORE_ATTENTION, RECALL_ATTENTION, REGISTER_REGION,
      UNREGISTER_REGION, REGION_STATUS
    """
    HELLO = "hello"
    STATUS = "status"
    TAKEN = "taken"
    DONE = "done"
    BOARD = "board"
    SEEN = "seen"
    RUN = "run"
    CANCEL = "cancel"
    EXPLAIN = "explain"
    SIDE = "side"
    LOAD = "load"
    UNLOAD = "unload"
    INDEX = "index"
    STORE_ATTENTION = "store_attention"
    RECALL_ATTENTION = "recall_attention"
    REGISTER_REGION = "register_region"
    UNREGISTER_REGION = "unregister_region"
    REGION_STATUS = "region_status"


def pack(message: dict, arrays: dict[str, np.ndarray] | None = None) -> bytes:
    arrays = {name: np.ascontiguousarray(a) for name, a in (arrays or {}).items()}
    header = json.dumps({**message, "arrays": [[n, a.dtype.str, list(a.shape)] for n, a in arrays.items()]}).encode()
    blob = b"".join(a.tobytes() for a in arrays.values())
    return _SIZES.pack(len(header), len(blob)) + header + blob


async def receive(reader: asyncio.StreamReader) -> tuple[dict, dict[str, np.ndarray]]:
    """The next message; asyncio.IncompleteReadError when the other side has gone."""
    header_size, blob_size = _SIZES.unpack(await reader.readexactly(_SIZES.size))
    body = await reader.readexactly(header_size + blob_size)
    message, blob = json.loads(body[:header_size]), memoryview(body)[header_size:]
    arrays, offset = {}, 0
    for name, dtype, shape in message.pop("arrays"):
        a = np.frombuffer(blob, np.dtype(dtype), math.prod(shape), offset).reshape(shape)
        arrays[name] = a
        offset += a.nbytes
    return message, arrays


def result_to_wire(record: AttentionResult) -> tuple[dict, dict[str, np.ndarray]]:
    attention = {f"attention/{k}": v for k, v in record.attention.items()}
    arrays = {"image": record.image, "photo": record.photo, **attention}
    return {"model": record.model, "size": list(record.size)}, arrays


def result_from_wire(message: dict, arrays: dict[str, np.ndarray]) -> AttentionResult:
    attention = {k.removeprefix("attention/"): v for k, v in arrays.items() if k.startswith("attention/")}
    return AttentionResult(message["model"], attention, arrays["image"], arrays["photo"], tuple(message["size"]))
