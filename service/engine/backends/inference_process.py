"""The inference process of the process backend: a LocalBackend (sessions, batchers, attention cache) serving
the HTTP workers over a Unix socket.

Its work per request is what keeps a GPU host's throughput down, since it is one process: so a worker sends
its requests for a model in *frames*, one message for all the requests it holds (their slots in its
shared-memory arena, as arrays), and gets two messages back per frame: "taken" once the frame's requests are all
in batches (the worker then sends the next frame, with whatever came meanwhile) and "done" once every result is
written into the records, with the errors of any request that failed. The batcher gathers the records of every
worker's frames into one batch, and results are written back per worker in one numpy call per output
(records.spans). A worker counts the requests it is decoding in shared memory too (its *board*), so a partial
batch waits for them without a message. Model status is pushed to every worker as it changes, so readiness
answers locally. SIGTERM (from the supervisor, once the workers have drained) stops it; SIGINT is left to the
supervisor.
"""
import asyncio
import dataclasses
import gc
import logging
import os
import signal
from collections.abc import Coroutine, Iterable
from pathlib import Path

import numpy as np

from service.core import tracing
from service.core.errors import ServiceError, overloaded, to_wire
from service.core.metrics import Metrics
from service.core.settings import Settings

from ..batching import Batcher, Entry
from ..records import Kind, record_dtype
from ..shared_memory import Claim, SharedIO
from . import wire
from .arena import map_records
from .board import BOARD_SLOTS, JPEG_ROOM, Board
from .device_health import BROKEN_EXIT_STATUS
from .heartbeat import HEARTBEAT, PULSE_S, Heartbeat
from .local import LocalBackend
from .wire import Op

log = logging.getLogger("vitserve")


@dataclasses.dataclass(eq=False)
class Frame:
    """One worker's requests for one model and kind, sent as one message and queued as one batcher entry."""
    key: int
    writer: asyncio.StreamWriter
    records: np.ndarray  # the worker's arena the requests' slots are in
    starts: np.ndarray  # each request's first slot and slot count, in the frame's order
    counts: np.ndarray
    batcher: Batcher | None = None
    entry: Entry | None = None
    taken: bool = False  # told
    # by a request's place in the frame: the errors of those that failed, their shared memory, those given up
    errors: dict[int, dict] = dataclasses.field(default_factory=dict)
    claims: dict[int, Claim] = dataclasses.field(default_factory=dict)
    cancelled: set[int] = dataclasses.field(default_factory=set)


class InferenceServer:
    def __init__(self, settings: Settings, socket_path: Path):
        self.settings, self.socket_path = settings, socket_path
        self.backend = LocalBackend(settings, Metrics(), on_status=self._push_status, on_broken=_exit_broken)
        self.backend.models.max_models = BOARD_SLOTS
        # a restarted inference process writes the same file, which the workers keep mapped
        self.backend.jpeg_room = Board.lasting(socket_path.parent / JPEG_ROOM)
        self._writers: set[asyncio.StreamWriter] = set()
        self._seen: dict[asyncio.StreamWriter, int] = {}  # the status generation each worker acknowledged
        self.backend.models.seen_everywhere = self._seen_everywhere
        self._tasks: set[asyncio.Task] = set()
        self._frames: dict[tuple[asyncio.StreamWriter, int], Frame] = {}  # open frames, by worker and key

    def _status_message(self) -> dict:
        """The models, in the order of the workers' boards (a reload's new manifest, a new model last), and their
        status."""
        return {"op": Op.STATUS, "generation": self.backend.generation,
                "status": {k: dataclasses.asdict(v) for k, v in self.backend.status().items()},
                "entries": [{"folder": str(e.folder), "manifest": e.manifest} for e in self.backend.entries]}

    def _push_status(self) -> None:
        frame = wire.pack(self._status_message())
        for writer in self._writers:
            writer.write(frame)

    async def _seen_everywhere(self, generation: int) -> None:
        """Once every connected worker has acknowledged status `generation` (one that has gone needs not)."""
        while any(self._seen.get(writer, -1) < generation for writer in self._writers):
            await asyncio.sleep(0.002)

    async def serve(self, stop: asyncio.Event) -> None:
        """Serve the workers until `stop` is set, then finish what they wait for."""
        pulse = asyncio.create_task(self._pulse(Heartbeat(self.socket_path.parent / HEARTBEAT)), name="pulse")
        await self.backend.start()
        gc.freeze()  # as the HTTP workers do (app.py): start-up's objects out of the collector's way
        gc.set_threshold(50_000)
        server = await asyncio.start_unix_server(self._connection, self.socket_path)
        log.info("inference process ready for workers at %s", self.socket_path)
        await stop.wait()
        server.close()
        while self._frames or self._tasks:  # what the workers still wait for
            await asyncio.sleep(0.01)
        pulse.cancel()
        await self.backend.close()

    async def _pulse(self, heartbeat: Heartbeat) -> None:
        """Beat while the event loop runs, saying whether the batches moved (one finished, or none waits)."""
        seen = -1
        while True:
            batchers = list(self.backend.batchers.values())
            finished = sum(b.finished for b in batchers)
            heartbeat.beat(progressed=finished != seen or not any(b.busy for b in batchers))
            seen = finished
            await asyncio.sleep(PULSE_S)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        arenas: dict[str, np.ndarray] = {}  # this worker's arenas, mapped on first use
        writer.write(wire.pack({**self._status_message(), "op": Op.HELLO, "problems": self.backend.problems}))
        self._writers.add(writer)
        board = None
        try:
            while True:
                message, arrays = await wire.receive(reader)
                op = message["op"]
                if op == Op.RUN:
                    self._submit(message, arrays, arenas, writer)
                elif op == Op.SEEN:  # this worker routes by that status from now on
                    self._seen[writer] = message["generation"]
                elif op == Op.CANCEL:
                    self._cancel(writer, message)
                elif op == Op.BOARD:
                    board = self.backend.boards.join(self.socket_path.parent / message["board"])
                else:
                    self._track(self._answer(message, arrays, writer))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the worker has gone: its queued requests are abandoned
        finally:
            self._writers.discard(writer)
            self._seen.pop(writer, None)
            if board is not None:
                self.backend.boards.leave(board)
            for (owner, _), frame in list(self._frames.items()):
                if owner is writer and frame.entry is not None:
                    frame.entry.future.cancel()
            writer.close()

    def _submit(self, message: dict, arrays: dict, arenas: dict, writer: asyncio.StreamWriter) -> None:
        """A frame's requests onto the batcher as one entry: the slots of the worker's arena they filled. Requests
        the queue has no room for are refused, the frame's last ones first, as are those whose shared memory
        cannot be had."""
        model, kind = message["model"], message["kind"]
        key = message["arena"]
        if key not in arenas:
            dtype = record_dtype(self.backend.models.by_key[model], kind)
            path = self.socket_path.parent / key
            arenas[key] = map_records(path, dtype, path.stat().st_size // dtype.itemsize)
        starts, counts = arrays["start"], arrays["count"]
        frame = self._frames[writer, message["frame"]] = Frame(message["frame"], writer, arenas[key], starts, counts)
        try:
            frame.batcher = batcher = self.backend.batcher(model)
        except ServiceError as e:
            return self._refuse_all(frame, e)
        inputs = self._requests_inputs(frame, message, arrays, kind)  # refuses requests whose memory is not there
        kept = np.arange(len(starts))
        if frame.errors:
            kept = np.array([i for i in kept if i not in frame.errors], np.int64)
        ends = np.cumsum(counts[kept])
        fits = int(np.searchsorted(ends, batcher.room, "right"))
        if fits < len(kept):
            busy = overloaded(f"{model} is busy: {batcher.depth} images are queued, and more would pass its limit of "
                              f"{batcher.policy.queue_limit}; retry later", self.settings.retry_after_s)
            self._fail(frame, kept[fits:], busy)
            kept, ends = kept[:fits], ends[:fits]
        if not len(kept):
            return self._done(frame)
        images = int(ends[-1])
        rows = np.repeat(starts[kept] - (ends - counts[kept]), counts[kept]) + np.arange(images)
        row_inputs = None if inputs is None else [x for i in kept.tolist() for x in inputs[i]]
        traces = message.get("traces")  # (traces on)
        frame.entry = batcher.submit(frame.records, int(arrays["top_k"][kept].max()), row_inputs, rows,
                                     on_taken=lambda: self._taken(frame),
                                     traces=traces and [traces[i] for i in kept.tolist()],
                                     priority=message.get("priority", 0))
        frame.entry.future.add_done_callback(lambda future: self._finished(frame, future))

    def _requests_inputs(self, frame: Frame, message: dict, arrays: dict, kind: str) -> list[list] | None:
        """Each request's rows' inputs where the records do not hold them (JPEG bytes, or views of shared memory),
        else None. Requests with tensors in shared memory claim it (Frame.claims); those that cannot are refused."""
        if kind == Kind.JPEG:
            edges = np.concatenate([[0], np.cumsum(arrays["jpeg_size"])]).tolist()
            blob = arrays["jpegs"].tobytes()
            jpegs = [blob[a:b] for a, b in zip(edges, edges[1:])]
            bounds = np.concatenate([[0], np.cumsum(frame.counts)]).tolist()
            return [jpegs[a:b] for a, b in zip(bounds, bounds[1:])]
        if "shared" not in message:
            return None
        inputs = []
        for i, io in enumerate(message["shared"]):
            inputs.append([])
            if io is None:
                continue
            first = int(frame.starts[i])
            try:
                claim = self.backend.regions.claim(SharedIO.from_wire(io), frame.records[first:first + frame.counts[i]],
                                                   kind)
            except ServiceError as e:
                self._fail(frame, [i], e)
                continue
            frame.claims[i] = claim
            inputs[-1] = claim.inputs or []
        return inputs if any(io is not None and io[0] is not None for io in message["shared"]) else None

    def _fail(self, frame: Frame, requests: Iterable[int], error: Exception) -> None:
        if not isinstance(error, ServiceError):
            error = ServiceError(f"the inference process failed: {type(error).__name__}: {error}")
        frame.errors.update((int(i), to_wire(error)) for i in requests)

    def _refuse_all(self, frame: Frame, error: ServiceError) -> None:
        self._fail(frame, range(len(frame.starts)), error)
        self._done(frame)

    def _cancel(self, writer: asyncio.StreamWriter, message: dict) -> None:
        """A client has gone: its request's slots leave the queue, those not yet in a batch."""
        frame = self._frames.get((writer, message["frame"]))
        if frame is not None and frame.entry is not None:
            i = message["request"]
            frame.cancelled.add(i)
            first = int(frame.starts[i])
            frame.batcher.drop(frame.entry, first, first + int(frame.counts[i]))

    def _finished(self, frame: Frame, future: asyncio.Future) -> None:
        if future.cancelled():  # the worker has gone, or the process stops: nobody to answer
            self._frames.pop((frame.writer, frame.key), None)
            self._release(frame)
            return
        if (error := future.exception()) is not None:  # the batch failed: every request in it
            self._fail(frame, range(len(frame.starts)), error)
        else:
            for row, failed in future.result().items():  # images that failed alone: their requests
                owner = np.flatnonzero((frame.starts <= row) & (row < frame.starts + frame.counts))[0]
                self._fail(frame, [owner], failed)
        self._done(frame)

    def _tell(self, frame: Frame, message: dict) -> None:
        if not frame.writer.is_closing():
            frame.writer.write(wire.pack(message))

    def _taken(self, frame: Frame) -> None:
        """The frame's requests are all in batches that started: the worker may send the next."""
        if not frame.taken:
            frame.taken = True
            self._tell(frame, {"op": Op.TAKEN, "frame": frame.key})

    def _release(self, frame: Frame, answered: bool = False) -> None:
        """The frame's shared memory let go, once the outputs of its requests answered are written there."""
        for i, claim in frame.claims.items():
            first = int(frame.starts[i])
            if answered and i not in frame.errors and i not in frame.cancelled:
                claim.write(frame.records[first:first + frame.counts[i]])
            claim.release()
        frame.claims.clear()

    def _done(self, frame: Frame) -> None:
        """The frame's answer: the worker frees its slots on it."""
        self._release(frame, answered=True)
        self._taken(frame)
        self._frames.pop((frame.writer, frame.key), None)
        self._tell(frame, {"op": Op.DONE, "frame": frame.key, "errors": list(frame.errors.items())})

    def _track(self, work: Coroutine) -> asyncio.Task:
        """`work` as a task that stopping waits for."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _answer(self, message: dict, arrays: dict, writer: asyncio.StreamWriter) -> None:
        reply, out = {"id": message["id"]}, {}
        try:
            reply_fields, out = await self._handle(message, arrays)
            reply.update(reply_fields)
        except ServiceError as e:
            reply["error"] = to_wire(e)
        except Exception as e:  # an unexpected failure fails the request, not the process
            log.exception("%s failed", message.get("op"))
            reply["error"] = to_wire(ServiceError(f"the inference process failed: {type(e).__name__}: {e}"))
        if not writer.is_closing():
            writer.write(wire.pack(reply, out))

    async def _handle(self, message: dict, arrays: dict) -> tuple[dict, dict]:
        op, backend = message["op"], self.backend
        if op == Op.EXPLAIN:
            layers = await backend.explain(message["model"], arrays["image"])
            return {}, {str(i): layer for i, layer in enumerate(layers)}
        if op == Op.SIDE:  # (each message answered in a task of its own: the requests batch together)
            return {}, await backend.side(message["model"], message["graph"], arrays)
        if op in (Op.LOAD, Op.UNLOAD):
            await getattr(backend.models, op)(message["model"])
            return {}, {}
        if op == Op.INDEX:
            return {"models": await backend.models.index()}, {}
        if op == Op.STORE_ATTENTION:
            return {"kept": await backend.store_attention(message["key"], wire.result_from_wire(message, arrays))}, {}
        if op == Op.REGISTER_REGION:
            await backend.register_region(message["name"], message["key"], message["offset"], message["byte_size"])
            return {}, {}
        if op == Op.UNREGISTER_REGION:
            await backend.unregister_region(message["name"])
            return {}, {}
        if op == Op.REGION_STATUS:
            return {"regions": await backend.region_status(message["name"])}, {}
        if op == Op.RECALL_ATTENTION:
            record = await backend.recall_attention(message["key"])
            return wire.result_to_wire(record) if record is not None else ({"missing": True}, {})
        raise ServiceError(f"unknown operation {op!r}")


def _exit_broken(why: str) -> None:
    """A device that fails every batch is not cured in this process: it exits at once (a drain would wait on the
    device), the workers answer 503 `inference_restarting`, and the supervisor starts another."""
    logging.shutdown()
    os._exit(BROKEN_EXIT_STATUS)


def main(settings: Settings, socket_path: Path, log_level: str) -> None:
    """The process's entry point (multiprocessing, spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which stops us last
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s inference: %(message)s")

    tracing.enable("inference")

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await InferenceServer(settings, socket_path).serve(stop)

    asyncio.run(run())
    tracing.shut_down()
