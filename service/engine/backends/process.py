"""The HTTP worker's side of the process backend: records in shared memory, batches in the inference process.

Each worker (a uvicorn process on the shared listening socket) parses and decodes on its own cores, straight
into its arenas. Its requests for a model wait in an *outbox* and travel to the inference process as *frames*
(inference_process.py), one message however many requests: at once when none of this worker's frames for the model waits
in the inference process's queue, else as soon as the waiting one is in a batch that started ("taken"). So a
lone request goes at once, and under load a batch holds about one frame per worker, each with every request that
came meanwhile: the one inference process works per frame and per batch, not per request. Results come back in
the same records, with one "done" per frame. A worker counts on its *board* (shared memory) the requests for each
model that could still join the batch being gathered (decoding or in the outbox; none while one of its frames
waits), so that a partial batch waits for those alone. A request given up (client gone, timeout) leaves the
outbox, or its slots leave the inference process's queue; its records stay leased until its frame's "done", when
nothing writes into them any more. Model status is pushed by the inference process; attention results are kept
there too, so any worker can answer GET /attention-map.
"""
import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from repository import ModelEntry
from service.core import tracing
from service.core.errors import Unavailable, from_wire, overloaded
from service.core.settings import Settings
from service.core.urgency import request_priority
from service.explain.cache import AttentionResult

from ..batching import BatchingPolicy
from ..records import Kind, kind_of, record_dtype
from ..shared_memory import SharedIO
from ..side_graphs import Batch
from . import Lease, ModelStatus, graph_entry, wire
from .arena import Arena
from .board import JPEG_ROOM, Board
from .heartbeat import HEARTBEAT, Heartbeat
from .wire import Op

log = logging.getLogger("vitserve")


@dataclass(eq=False)
class Slots(Lease):
    """A request's records: n slots of an arena, from `start`, freed once the request is done with them and no run
    is in flight (a request that gave up must not free slots the inference process is still writing into)."""
    arena: Arena
    start: int
    n: int
    holders: int = 1

    def release(self) -> None:
        self.holders -= 1
        if self.holders == 0:
            self.arena.give_back(self.start, self.n)


@dataclass(eq=False)
class _Queued:
    """A request in an outbox, then in a frame until the frame's "done"."""
    lease: Slots
    top_k: int
    jpegs: list[bytes] | None
    shared: SharedIO | None  # its tensors in shared memory, which the inference process reads and writes
    future: asyncio.Future
    since: float  # when it was queued here
    trace: str | None  # its span as a W3C traceparent, where traces are on (tracing.py)
    priority: int  # its level, 1 first; 0: the default (urgency.py)
    frame: int | None = None
    index: int = 0  # its place in the frame, by which the inference process names it
    sent: float = 0.0


@dataclass(eq=False)
class _Outbox:
    """A worker's requests for one model: those decoding, those waiting to be sent, and the frames sent that the
    inference process has not yet put into a batch that started."""
    model: str
    index: int  # on the board
    decoding: int = 0
    pending: list[_Queued] = field(default_factory=list)
    queued: set[int] = field(default_factory=set)  # frames
    flushing: bool = False  # a send is scheduled


class _ModelControl:
    """The inference process's model control (lifecycle.py), asked over the socket."""

    def __init__(self, ask: Callable[[dict], Awaitable[tuple[dict, dict]]]):
        self._ask = ask

    async def load(self, model: str) -> None:
        await self._ask({"op": Op.LOAD, "model": model})

    async def unload(self, model: str) -> None:
        await self._ask({"op": Op.UNLOAD, "model": model})

    async def index(self) -> list[dict]:
        reply, _ = await self._ask({"op": Op.INDEX})
        return reply["models"]


class ProcessBackend:
    def __init__(self, settings: Settings, socket_path: Path, connect_timeout_s: float = 120.0):
        self.settings, self.socket_path, self.connect_timeout_s = settings, socket_path, connect_timeout_s
        self.entries: list[ModelEntry] = []
        self.problems: dict[str, str] = {}
        self.models = _ModelControl(self._ask)
        self._status: dict[str, ModelStatus] = {}
        self._loaded = asyncio.Event()
        self._arenas: dict[tuple[str, str], Arena] = {}
        self._outboxes: dict[str, _Outbox] = {}
        self._frames: dict[int, tuple[_Outbox, list[_Queued]]] = {}  # sent, not yet done
        self._pending: dict[int, asyncio.Future] = {}  # other questions, by id
        self._ids = iter(range(1, 2**62))
        self._tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"  # names this worker's shared memory
        self.generation = 0  # counts status changes
        self._board_path = socket_path.parent / f"board-{self._tag}"
        self._board: Board | None = None  # requests on their way, per model (entries' order): _tell
        self._jpeg_room: Board | None = None  # the inference process's: room in each GPU decoder queue
        self._heartbeat: Heartbeat | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._connected = False
        self._reader_task: asyncio.Task | None = None

    async def start(self) -> None:
        self._board = Board.shared(self._board_path, create=True)
        self._heartbeat = Heartbeat(self.socket_path.parent / HEARTBEAT)
        reader = await self._join(self.connect_timeout_s)
        self._jpeg_room = Board.shared(self.socket_path.parent / JPEG_ROOM)  # (made before the socket listened)
        self._reader_task = asyncio.get_running_loop().create_task(self._follow(reader), name="inference-replies")

    async def _join(self, timeout_s: float | None) -> asyncio.StreamReader:
        """Connect to the inference process (waiting for its socket), read its hello and show it this worker's
        board."""
        while True:
            reader = await self._connect(timeout_s)
            try:
                message, _ = await wire.receive(reader)  # hello
                break
            except (asyncio.IncompleteReadError, ConnectionError):  # a dying process's socket took it: the next
                self._writer.close()
                await asyncio.sleep(0.05)
        self.problems = message["problems"]
        self._writer.write(wire.pack({"op": Op.BOARD, "board": self._board_path.name}))
        self._set_status(message)
        self._connected = True
        return reader

    async def _connect(self, timeout_s: float | None) -> asyncio.StreamReader:
        """The inference process starts beside the workers, or again after it died: wait for its socket (a dead
        one's socket file refuses connections)."""
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                reader, self._writer = await asyncio.open_unix_connection(self.socket_path)
                return reader
            except (FileNotFoundError, ConnectionRefusedError):
                if deadline is not None and asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.05)

    async def _follow(self, reader: asyncio.StreamReader) -> None:
        """The inference process's replies; when it has gone, what waited on it is answered 503 at once and the
        one the supervisor starts next is joined, without a restart of this worker."""
        while True:
            await self._read(reader)
            self._lost()
            reader = await self._join(None)
            log.info("joined the new inference process")

    def _set_status(self, message: dict) -> None:
        """The inference process's models (a reloaded one with its new manifest, one loaded since start-up last:
        its outbox counts in the next board slot) and their status."""
        self.entries = [ModelEntry(Path(e["folder"]), e["manifest"]) for e in message["entries"]]
        for i, entry in enumerate(self.entries):
            outbox = self._outboxes.setdefault(entry.key, _Outbox(entry.key, i))
            if outbox.index != i:  # a new inference process may list the models in another order
                outbox.index = i
                self._tell(outbox)
        self._status = {name: ModelStatus(**s) for name, s in message["status"].items()}
        self.generation += 1
        # acknowledged: what this worker routes from now on follows this status (an unload waits for it)
        self._writer.write(wire.pack({"op": Op.SEEN, "generation": message["generation"]}))
        if all(s.settled for s in self._status.values()):
            self._loaded.set()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        """Replies, until the inference process has gone."""
        try:
            while True:
                message, arrays = await wire.receive(reader)
                op = message.get("op")
                if op == Op.TAKEN:
                    self._taken(message["frame"])
                elif op == Op.DONE:
                    self._done(message["frame"], message["errors"])
                elif op == Op.STATUS:
                    self._set_status(message)
                else:
                    future = self._pending.pop(message["id"])
                    if future.done():
                        continue
                    if "error" in message:
                        future.set_exception(from_wire(message["error"]))
                    else:
                        future.set_result((message, arrays))
        except (asyncio.IncompleteReadError, ConnectionError):
            log.error("the inference process has gone")

    def _lost(self) -> None:
        """The inference process has gone: everything that waited on it fails (503), and the slots of the frames
        it held are this worker's again (nothing writes into them any more)."""
        self._connected = False
        self._writer.close()
        gone = self._gone()
        for _, queued in self._frames.values():
            for q in queued:
                q.lease.release()
        waiting = [*self._pending.values(), *(q.future for _, queued in self._frames.values() for q in queued),
                   *(q.future for outbox in self._outboxes.values() for q in outbox.pending)]
        for future in waiting:
            if not future.done():
                future.set_exception(gone)
        self._pending.clear()
        self._frames.clear()
        for outbox in self._outboxes.values():
            outbox.pending, outbox.flushing = [], False
            outbox.queued.clear()
            self._tell(outbox)

    def _gone(self) -> Unavailable:
        return Unavailable("the inference process has stopped; the supervisor is starting another",
                           "inference_restarting", self.settings.retry_after_s)

    def problem(self) -> Unavailable | None:
        """Why nothing can be served now: the inference process is restarting, or it has made no progress for
        longer than VITSERVE_INFERENCE_UNREADY_AFTER_S (hung, or a batch that long); None where it serves."""
        if not self._connected:
            return self._gone()
        silence = self._heartbeat.silence()
        if silence is not None and silence > self.settings.inference_unready_after_s:
            return Unavailable(f"the inference process has made no progress for {silence:.0f}s; it is replaced after "
                               f"{self.settings.inference_kill_after_s:g}s (VITSERVE_INFERENCE_KILL_AFTER_S)",
                               "inference_unresponsive", self.settings.retry_after_s)
        return None

    def _taken(self, key: int) -> None:
        """The frame's requests are all in batches that started: the outbox's next frame may go."""
        outbox, _ = self._frames[key]
        outbox.queued.discard(key)
        self._flush(outbox)

    def _done(self, key: int, errors: list[tuple[int, dict]]) -> None:
        """A frame's answer (always after its "taken"): its results are in the records, its slots free once their
        requests are over; `errors`: (a request's place in the frame, its error) for those that failed."""
        outbox, queued = self._frames.pop(key)
        outbox.queued.discard(key)
        failed = dict(errors)
        for q in queued:
            q.lease.release()
            if q.future.done():
                continue
            if (error := failed.get(q.index)) is not None:
                q.future.set_exception(from_wire(error))
                continue
            # the queue time a client sees: in the outbox here, then in the inference process
            q.lease.arena.records["queue_ms"][q.lease.start:q.lease.start + q.lease.n] += (q.sent - q.since) * 1e3
            q.future.set_result(None)

    def _check_connected(self) -> None:
        if not self._connected:
            raise self._gone()

    async def _ask(self, message: dict, arrays: dict | None = None):
        self._check_connected()
        key = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        self._writer.write(wire.pack({**message, "id": key}, arrays))
        return await future

    async def loaded(self) -> None:
        await self._loaded.wait()

    def status(self) -> dict[str, ModelStatus]:
        return self._status

    def _arena(self, model: str, kind: str) -> Arena:
        if (model, kind) not in self._arenas:
            entry = next(e for e in self.entries if e.key == model)
            # a worker never needs more slots than the whole queue may hold, plus one request being decoded
            queue = BatchingPolicy.of(self.settings, graph_entry(self.entries, self._status, model), entry).queue_limit
            slots = queue + self.settings.max_files
            path = self.socket_path.parent / f"arena-{self._tag}-{model}-{kind}"
            self._arenas[model, kind] = Arena(path, record_dtype(entry, kind), slots)
        return self._arenas[model, kind]

    @contextmanager
    def records(self, model: str, kind: str, n: int) -> Iterator[Slots]:
        arena = self._arena(model, kind)
        start = arena.take(n)
        if start is None:
            raise overloaded(f"this worker has no room for {n} more {model} images", self.settings.retry_after_s)
        lease = Slots(arena.records[start:start + n], arena, start, n)
        try:
            yield lease
        finally:
            lease.release()

    @contextmanager
    def preparing(self, model: str) -> Iterator[None]:
        """Counted on the board, so that the inference process's batcher may wait for these images."""
        outbox = self._outboxes[model]
        outbox.decoding += 1
        self._tell(outbox)
        try:
            yield
        finally:
            outbox.decoding -= 1
            self._tell(outbox)

    def _tell(self, outbox: _Outbox) -> None:
        """The board's count for the model: the requests that could still join the batch being gathered, so none
        while one of this worker's frames waits to be taken (what comes meanwhile goes in the next frame)."""
        self._board.tell(outbox.index, 0 if outbox.queued else outbox.decoding + len(outbox.pending))

    def gpu_room(self, model: str) -> int:
        """The inference process's reading, less this worker's JPEGs held back for the model's next frame."""
        outbox = self._outboxes[model]
        return int(self._jpeg_room.counts[outbox.index]) - sum(q.lease.n for q in outbox.pending if q.jpegs)

    def run_here(self, model: str, lease: Slots, top_k: int, trace: str | None = None) -> bool:
        return False  # the sessions are in the inference process

    async def run(self, model: str, lease: Slots, top_k: int, jpegs: list[bytes] | None = None,
                  shared: SharedIO | None = None) -> None:
        self._check_connected()
        outbox = self._outboxes[model]
        q = _Queued(lease, top_k, jpegs, shared,
                    asyncio.get_running_loop().create_future(), time.perf_counter(), tracing.traceparent(),
                    request_priority())
        outbox.pending.append(q)
        self._tell(outbox)
        # after this turn of the loop, so that others may join; a request of a first level goes past this worker's
        # frames still waiting in the queue, which it would otherwise wait behind
        if (not outbox.queued or q.priority) and not outbox.flushing:
            outbox.flushing = True
            asyncio.get_running_loop().call_soon(self._flush, outbox)
        try:
            await q.future
        except asyncio.CancelledError:  # our caller gave up (its client left, or it timed out): so does the work
            if q.frame is None:
                outbox.pending.remove(q)
                self._tell(outbox)
            elif q.frame in self._frames and not self._writer.is_closing():
                self._writer.write(wire.pack({"op": Op.CANCEL, "frame": q.frame, "request": q.index}))
            raise

    def _flush(self, outbox: _Outbox) -> None:
        """The outbox's requests as one frame per kind, place of the input (the records, or shared memory) and
        priority level; while the inference process still holds frames of it that no batch has taken, only those
        of a level above the default."""
        outbox.flushing = False
        sent = [q for q in outbox.pending if q.priority] if outbox.queued else outbox.pending
        if not sent or self._writer.is_closing():
            return
        now = time.perf_counter()
        by_arena: dict[tuple[Arena, bool, int], list[_Queued]] = {}
        for q in sent:
            by_arena.setdefault((q.lease.arena, q.shared is not None and q.shared.input is not None, q.priority),
                                []).append(q)
        outbox.pending = [q for q in outbox.pending if not q.priority] if outbox.queued else []
        for (arena, _, priority), queued in by_arena.items():
            key = next(self._ids)
            for i, q in enumerate(queued):
                q.lease.holders += 1  # held until the frame's "done", whatever happens to the request
                q.frame, q.index, q.sent = key, i, now
            arrays = {"start": np.array([q.lease.start for q in queued], np.int32),
                      "count": np.array([q.lease.n for q in queued], np.int32),
                      "top_k": np.array([q.top_k for q in queued], np.int32)}
            kind = kind_of(arena.records)
            message = {"op": Op.RUN, "frame": key, "model": outbox.model, "kind": kind, "arena": arena.path.name}
            if any(q.shared is not None for q in queued):
                message["shared"] = [None if q.shared is None else q.shared.to_wire() for q in queued]
            if any(q.trace is not None for q in queued):  # (traces on: the batch's span joins them)
                message["traces"] = [q.trace for q in queued]
            if priority:
                message["priority"] = priority
            if kind == Kind.JPEG:
                jpegs = [data for q in queued for data in q.jpegs]
                arrays["jpegs"] = np.frombuffer(b"".join(jpegs), np.uint8)
                arrays["jpeg_size"] = np.array([len(data) for data in jpegs], np.int64)
            self._frames[key] = (outbox, queued)
            outbox.queued.add(key)
            self._writer.write(wire.pack(message, arrays))
        self._tell(outbox)

    async def explain(self, model: str, image: np.ndarray) -> list[np.ndarray]:
        _, arrays = await self._ask({"op": Op.EXPLAIN, "model": model}, {"image": image})
        return [arrays[str(i)] for i in range(len(arrays))]

    async def side(self, model: str, name: str, inputs: Batch) -> Batch:
        _, arrays = await self._ask({"op": Op.SIDE, "model": model, "graph": name}, inputs)
        return arrays

    async def register_region(self, name: str, key: str, offset: int, byte_size: int) -> None:
        await self._ask({"op": Op.REGISTER_REGION, "name": name, "key": key, "offset": offset,
                         "byte_size": byte_size})

    async def unregister_region(self, name: str) -> None:
        await self._ask({"op": Op.UNREGISTER_REGION, "name": name})

    async def region_status(self, name: str) -> list[dict]:
        reply, _ = await self._ask({"op": Op.REGION_STATUS, "name": name})
        return reply["regions"]

    async def store_attention(self, key: str, result: AttentionResult) -> bool:
        message, arrays = wire.result_to_wire(result)
        reply, _ = await self._ask({"op": Op.STORE_ATTENTION, "key": key, **message}, arrays)
        return reply["kept"]

    async def recall_attention(self, key: str) -> AttentionResult | None:
        message, arrays = await self._ask({"op": Op.RECALL_ATTENTION, "key": key})
        return None if message.get("missing") else wire.result_from_wire(message, arrays)

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
        for arena in self._arenas.values():
            arena.close()
        self._board_path.unlink(missing_ok=True)
