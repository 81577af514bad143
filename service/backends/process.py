"""The HTTP worker's side of the process backend: records in shared memory, batches in the inference process.

Each worker (a uvicorn process on the shared listening socket) parses and decodes on its own cores, straight
into its arenas, and sends the inference process one small message per request saying which records to run.
Results come back in the same records. A request given up (client gone, timeout) is cancelled there too; its
records stay leased until the inference process answers for it, when nothing writes into them any more. Model
status is pushed by the inference process; attention results are kept there too, so any worker can answer
GET /attention-map.
"""
import asyncio
import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from repository import ModelEntry

from ..cache import AttentionRecord
from ..errors import Unavailable, from_wire, overloaded
from ..records import kind_of, record_dtype
from ..settings import Settings
from . import ModelStatus, wire
from .arena import Arena

log = logging.getLogger("vitserve")


@dataclass
class _Lease:
    """Slots of an arena held by a request: freed once the request is done with them and no run is in flight
    (a request that gave up must not free slots the inference process is still writing into)."""
    arena: Arena
    start: int
    n: int
    holders: int = 1

    def release(self) -> None:
        self.holders -= 1
        if self.holders == 0:
            self.arena.give_back(self.start, self.n)


class ProcessBackend:
    def __init__(self, settings: Settings, socket_path: Path, connect_timeout_s: float = 120.0):
        self.settings, self.socket_path, self.connect_timeout_s = settings, socket_path, connect_timeout_s
        self.entries: list[ModelEntry] = []
        self.problems: dict[str, str] = {}
        self._status: dict[str, ModelStatus] = {}
        self._loaded = asyncio.Event()
        self._arenas: dict[tuple[str, str], Arena] = {}
        self._leases: dict[int, _Lease] = {}  # by the records' address
        self._pending: dict[int, tuple[asyncio.Future, _Lease | None]] = {}
        self._ids = iter(range(1, 2**62))
        self._tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # names this worker's arenas
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None

    async def start(self) -> None:
        reader = await self._connect()
        message, _ = await wire.receive(reader)  # hello
        self.entries = [ModelEntry(Path(e["folder"]), e["manifest"]) for e in message["entries"]]
        self.problems = message["problems"]
        self._set_status(message["status"])
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader), name="inference-replies")

    async def _connect(self) -> asyncio.StreamReader:
        """The inference process starts beside the workers: wait for its socket."""
        deadline = asyncio.get_running_loop().time() + self.connect_timeout_s
        while True:
            try:
                reader, self._writer = await asyncio.open_unix_connection(self.socket_path)
                return reader
            except (FileNotFoundError, ConnectionRefusedError):
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.05)

    def _set_status(self, status: dict) -> None:
        self._status = {name: ModelStatus(**s) for name, s in status.items()}
        if all(s.ready or s.error for s in self._status.values()):
            self._loaded.set()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                message, arrays = await wire.receive(reader)
                if message.get("op") == "status":
                    self._set_status(message["status"])
                    continue
                future, lease = self._pending.pop(message["id"])
                if lease is not None:
                    lease.release()
                if future.done():
                    continue
                if "error" in message:
                    future.set_exception(from_wire(message["error"]))
                else:
                    future.set_result((message, arrays))
        except (asyncio.IncompleteReadError, ConnectionError):
            log.error("the inference process has gone")
            gone = Unavailable("the inference process has stopped", "inference_unavailable",
                               self.settings.retry_after_s)
            for future, _ in self._pending.values():
                if not future.done():
                    future.set_exception(gone)
            self._pending.clear()

    async def _ask(self, message: dict, arrays: dict | None = None, lease: _Lease | None = None):
        if self._writer is None or self._reader_task.done():
            raise Unavailable("the inference process has stopped", "inference_unavailable",
                              self.settings.retry_after_s)
        key = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[key] = (future, lease)
        if lease is not None:
            lease.holders += 1  # held until the reply, whatever happens to the caller
        self._writer.write(wire.pack({**message, "id": key}, arrays))
        try:
            return await future
        except asyncio.CancelledError:  # our caller gave up (its client left, or it timed out): so does the work
            if not self._writer.is_closing():
                self._writer.write(wire.pack({"op": "cancel", "id": key}))  # the lease is held until the reply
            raise

    async def loaded(self) -> None:
        await self._loaded.wait()

    def status(self) -> dict[str, ModelStatus]:
        return self._status

    def _arena(self, model: str, kind: str) -> Arena:
        if (model, kind) not in self._arenas:
            entry = next(e for e in self.entries if e.name == model)
            # a worker never needs more slots than the whole queue may hold, plus one request being decoded
            slots = self.settings.queue_limit + self.settings.max_files
            path = self.socket_path.parent / f"arena-{self._tag}-{model}-{kind}"
            self._arenas[model, kind] = Arena(path, record_dtype(entry, kind), slots)
        return self._arenas[model, kind]

    @contextmanager
    def records(self, model: str, kind: str, n: int) -> Iterator[np.ndarray]:
        arena = self._arena(model, kind)
        start = arena.take(n)
        if start is None:
            raise overloaded(f"this worker has no room for {n} more {model} images", self.settings.retry_after_s)
        lease = _Lease(arena, start, n)
        records = arena.records[start:start + n]
        self._leases[records.ctypes.data] = lease
        try:
            yield records
        finally:
            del self._leases[records.ctypes.data]
            lease.release()

    @contextmanager
    def preparing(self, model: str) -> Iterator[None]:
        """Tells the inference process's batcher, so that a partial batch may wait for these images."""
        self._tell_preparing(model, 1)
        try:
            yield
        finally:
            self._tell_preparing(model, -1)

    def _tell_preparing(self, model: str, requests: int) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(wire.pack({"op": "preparing", "model": model, "requests": requests}))

    async def run(self, model: str, records: np.ndarray, top_k: int, jpegs: list[bytes] | None = None) -> None:
        lease = self._leases[records.ctypes.data]
        arrays = {f"jpeg/{i}": np.frombuffer(data, np.uint8) for i, data in enumerate(jpegs or [])}
        await self._ask({"op": "run", "model": model, "kind": kind_of(records), "arena": lease.arena.path.name,
                         "start": lease.start, "count": lease.n, "top_k": top_k}, arrays, lease=lease)

    async def explain(self, model: str, image: np.ndarray) -> list[np.ndarray]:
        _, arrays = await self._ask({"op": "explain", "model": model}, {"image": image})
        return [arrays[str(i)] for i in range(len(arrays))]

    async def keep(self, key: str, record: AttentionRecord) -> bool:
        message, arrays = wire.record_to_wire(record)
        reply, _ = await self._ask({"op": "keep", "key": key, **message}, arrays)
        return reply["kept"]

    async def recall(self, key: str) -> AttentionRecord | None:
        message, arrays = await self._ask({"op": "recall", "key": key})
        return None if message.get("missing") else wire.record_from_wire(message, arrays)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
        for arena in self._arenas.values():
            arena.close()
