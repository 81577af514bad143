"""The inference process of the process backend: a LocalBackend (sessions, batchers, attention cache) serving
the HTTP workers over a Unix socket.

A worker's `run` message names records in its shared-memory arena; the batcher gathers them with other
workers' records into one batch, and the results are written back into those same records before the reply.
Batches are post-processed here, once each, vectorised (softmax, top-k, rows copied out). Model status is
pushed to every worker as it changes, so readiness answers locally. SIGTERM (from the supervisor, once the
workers have drained) stops it; SIGINT is left to the supervisor.
"""
import asyncio
import dataclasses
import gc
import logging
import signal
from collections.abc import Coroutine
from pathlib import Path

import numpy as np

from ..errors import ServiceError, to_wire
from ..metrics import Metrics
from ..records import record_dtype
from ..settings import Settings
from . import wire
from .arena import map_records
from .local import LocalBackend

log = logging.getLogger("vitserve")


class InferenceServer:
    def __init__(self, settings: Settings, socket_path: Path):
        self.settings, self.socket_path = settings, socket_path
        self.backend = LocalBackend(settings, Metrics(), on_status=self._push_status)
        self.entries = {e.name: e for e in self.backend.entries}
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()

    def _status_message(self) -> dict:
        return {"op": "status", "status": {k: dataclasses.asdict(v) for k, v in self.backend.status().items()}}

    def _push_status(self) -> None:
        frame = wire.pack(self._status_message())
        for writer in self._writers:
            writer.write(frame)

    async def serve(self, stop: asyncio.Event) -> None:
        """Serve the workers until `stop` is set, then finish what they wait for."""
        await self.backend.start()
        gc.freeze()  # as the HTTP workers do (app.py): start-up's objects out of the collector's way
        gc.set_threshold(50_000)
        server = await asyncio.start_unix_server(self._connection, self.socket_path)
        log.info("inference process ready for workers at %s", self.socket_path)
        await stop.wait()
        server.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)  # what the workers still wait for
        await self.backend.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        arenas: dict[str, np.ndarray] = {}  # this worker's arenas, mapped on first use
        entries = [{"folder": str(e.folder), "manifest": e.manifest} for e in self.backend.entries]
        writer.write(wire.pack({"op": "hello", "entries": entries, "problems": self.backend.problems,
                                **self._status_message()}))
        self._writers.add(writer)
        mine: dict[int, asyncio.Task] = {}  # by message id
        preparing: dict[str, int] = {}  # by model: requests this worker is decoding
        try:
            while True:
                message, arrays = await wire.receive(reader)
                if message["op"] == "preparing":  # no answer: partial batches may wait for these images
                    preparing[message["model"]] = preparing.get(message["model"], 0) + message["requests"]
                    self.backend.expect(message["model"], message["requests"])
                    continue
                if message["op"] == "cancel":  # its client has gone: stop the work, then answer for it
                    task = mine.get(message["id"])
                    if task is not None and task.cancel():
                        self._track(self._answer_cancelled(task, message["id"], writer))
                    continue
                key = message["id"]
                mine[key] = self._track(self._answer(message, arrays, arenas, writer))
                mine[key].add_done_callback(lambda _, key=key: mine.pop(key, None))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the worker has gone: its queued requests are abandoned
        finally:
            self._writers.discard(writer)
            for model, requests in preparing.items():
                self.backend.expect(model, -requests)
            for task in list(mine.values()):
                task.cancel()
            writer.close()

    def _track(self, work: Coroutine) -> asyncio.Task:
        """`work` as a task that stopping waits for."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _answer_cancelled(self, task: asyncio.Task, key: int, writer: asyncio.StreamWriter) -> None:
        """The reply to a cancelled request, once its task has ended: LocalBackend.run returns only when nothing
        writes into the request's records any more, and the worker frees them on this reply."""
        await asyncio.wait({task})
        if not writer.is_closing():
            writer.write(wire.pack({"id": key, "error": to_wire(ServiceError("cancelled: its client has gone",
                                                                             "cancelled"))}))

    async def _answer(self, message: dict, arrays: dict, arenas: dict, writer: asyncio.StreamWriter) -> None:
        reply, out = {"id": message["id"]}, {}
        try:
            reply_fields, out = await self._handle(message, arrays, arenas)
            reply.update(reply_fields)
        except ServiceError as e:
            reply["error"] = to_wire(e)
        except Exception as e:  # an unexpected failure fails the request, not the process
            log.exception("%s failed", message.get("op"))
            reply["error"] = to_wire(ServiceError(f"the inference process failed: {type(e).__name__}: {e}"))
        if not writer.is_closing():
            writer.write(wire.pack(reply, out))

    async def _handle(self, message: dict, arrays: dict, arenas: dict) -> tuple[dict, dict]:
        op, backend = message["op"], self.backend
        if op == "run":
            key = message["arena"]
            if key not in arenas:
                dtype = record_dtype(self.entries[message["model"]], message["kind"])
                path = self.socket_path.parent / key
                arenas[key] = map_records(path, dtype, path.stat().st_size // dtype.itemsize)
            start, count = message["start"], message["count"]
            jpegs = [arrays[f"jpeg/{i}"].tobytes() for i in range(count)] if message["kind"] == "jpeg" else None
            await backend.run(message["model"], arenas[key][start:start + count], message["top_k"], jpegs)
            return {}, {}
        if op == "explain":
            layers = await backend.explain(message["model"], arrays["image"])
            return {}, {str(i): layer for i, layer in enumerate(layers)}
        if op == "keep":
            return {"kept": await backend.keep(message["key"], wire.record_from_wire(message, arrays))}, {}
        if op == "recall":
            record = await backend.recall(message["key"])
            return wire.record_to_wire(record) if record is not None else ({"missing": True}, {})
        raise ServiceError(f"unknown operation {op!r}")


def main(settings: Settings, socket_path: Path, log_level: str) -> None:
    """The process's entry point (multiprocessing, spawn)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the supervisor, which stops us last
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s inference: %(message)s")

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await InferenceServer(settings, socket_path).serve(stop)

    asyncio.run(run())
