"""Dynamic batching, one batcher per served graph, with Triton's semantics.

Requests (each a block of image records) queue up; a batch runs as soon as it holds max_batch_size images or
its oldest image has waited max_queue_delay. A request larger than the room left is split across batches.
Unlike Triton, the batcher knows which requests are still decoding their images for this graph
(`preparing`): a partial batch waits only while one is, since nothing else could join it, so a lone client
never pays the delay (under the process backend the HTTP workers tell the inference process what they are
decoding). Up to `concurrency` batches run at once in the executor (2 on a GPU: one is copied in and
post-processed while the other computes); results are written into the requests' records there, and each
request's future is resolved once all its images are done. Beyond queue_limit queued images, new requests are
refused at once instead of growing the queue.
"""
import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .errors import ServiceError
from .metrics import Metrics
from .records import KINDS, Part

log = logging.getLogger("vitserve")


class QueueFull(Exception):
    """The graph's queue is at its limit."""


@dataclass
class _Request:
    records: np.ndarray
    top_k: int
    jpegs: list[bytes] | None
    future: asyncio.Future
    enqueued: float
    taken: int = 0  # records already in a batch
    left: int = 0  # records without results yet


# runs one batch in the executor: (parts, each part's queue ms) -> inference seconds
RunBatch = Callable[[list[Part], list[float]], float]


class Batcher:
    def __init__(self, name: str, run: RunBatch, executor: Executor, metrics: Metrics, max_batch_size: int,
                 max_queue_delay_s: float, queue_limit: int, concurrency: int = 1):
        self.name, self.run, self.executor, self.metrics = name, run, executor, metrics
        self.max_batch_size, self.max_queue_delay_s, self.queue_limit = max_batch_size, max_queue_delay_s, queue_limit
        self._waiting: deque[_Request] = deque()
        self._arrived = asyncio.Event()
        self._slots = asyncio.Semaphore(concurrency)
        self._running: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None
        self._preparing = 0  # requests decoding images that will come to this batcher
        self.depth = 0  # queued images not yet in a batch

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher-{self.name}")

    async def stop(self) -> None:
        """Stop taking batches; the running ones finish, what still waits is cancelled."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*self._running, return_exceptions=True)
        for request in self._waiting:
            request.future.cancel()
        self._waiting.clear()

    @contextmanager
    def preparing(self) -> Iterator[None]:
        """Around a request's decoding: while it runs, a partial batch may wait (up to the delay) for its images."""
        self.expect(1)
        try:
            yield
        finally:
            self.expect(-1)

    def expect(self, requests: int) -> None:
        """`requests` more (or, negative, fewer) requests are decoding images for this batcher."""
        self._preparing += requests

    def submit(self, records: np.ndarray, top_k: int = 1, jpegs: list[bytes] | None = None) -> asyncio.Future:
        """Queue the records (with their JPEG bytes, for "jpeg" records); the future resolves once results are
        written into all of them."""
        n = len(records)
        if self.depth + n > self.queue_limit:
            raise QueueFull(f"{self.name} is busy: {self.depth} images are queued, and this request's {n} would pass "
                            f"its limit of {self.queue_limit}; retry later")
        future = asyncio.get_running_loop().create_future()
        request = _Request(records, top_k, jpegs, future, time.perf_counter(), left=n)
        future.add_done_callback(lambda f: f.cancelled() and self._abandon(request))
        self._waiting.append(request)
        self.depth += n
        self.metrics.queue_depth.labels(self.name).set(self.depth)
        self._arrived.set()
        return future

    async def settled(self) -> None:
        """Every batch started so far has finished. A request cancelled before this is awaited has nothing left that
        writes into its records (the batch being gathered leaves it out), so they may be reused."""
        if self._running:
            await asyncio.wait(set(self._running))  # not gather: cancelling the caller must not cancel batches

    def _abandon(self, request: _Request) -> None:
        """Its caller went away (the client disconnected): what is not yet in a batch leaves the queue at once."""
        if request in self._waiting:
            self._waiting.remove(request)
            self.depth -= len(request.records) - request.taken
            self.metrics.queue_depth.labels(self.name).set(self.depth)

    async def _gather(self) -> list[tuple[_Request, Part]]:
        """Wait for a first image, then fill up until the batch is full, the first has waited long enough or no
        more images are on their way."""
        taken, room, deadline = [], self.max_batch_size, None
        while room:
            if self._waiting:
                request = self._waiting[0]
                if request.future.cancelled():  # abandoned, its callback not yet run
                    self._abandon(request)
                    continue
                deadline = deadline or request.enqueued + self.max_queue_delay_s
                n = min(room, len(request.records) - request.taken)
                rows = slice(request.taken, request.taken + n)
                jpegs = request.jpegs[rows] if request.jpegs is not None else None
                taken.append((request, Part(request.records, rows.start, rows.stop, request.top_k, jpegs)))
                request.taken += n
                room -= n
                self.depth -= n
                if request.taken == len(request.records):
                    self._waiting.popleft()
                continue
            self._arrived.clear()
            if not taken:
                await self._arrived.wait()
                continue
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or not self._preparing:
                break
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                break
        return [(request, part) for request, part in taken if not request.future.cancelled()]  # gone meanwhile

    async def _loop(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                taken = await self._gather()
            except BaseException:
                self._slots.release()
                raise
            self.metrics.queue_depth.labels(self.name).set(self.depth)
            if not taken:  # all of it given up while the batch was gathered
                self._slots.release()
                continue
            task = asyncio.get_running_loop().create_task(self._run(taken))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, taken: list[tuple[_Request, Part]]) -> None:
        taken.sort(key=lambda t: KINDS.index(t[1].kind))  # JPEGs and images first: their rows come back first
        start = time.perf_counter()
        waits = [start - request.enqueued for request, _ in taken]
        parts = [part for _, part in taken]
        try:
            elapsed = await asyncio.get_running_loop().run_in_executor(
                self.executor, self.run, parts, [w * 1e3 for w in waits])
        except Exception as e:  # a failed batch fails its requests, not the batcher
            log.exception("%s: a batch of %d images failed", self.name, sum(p.size for p in parts))
            failed = ServiceError(f"inference failed on this request's batch: {type(e).__name__}: {e}",
                                  "inference_failed")
            for request, _ in taken:
                if not request.future.done():
                    request.future.set_exception(failed)
            return
        finally:
            self._slots.release()
        # let the loop start the next batch before it answers this one's requests, so that the inference thread
        # is not idle while they are encoded
        await asyncio.sleep(0)
        self.metrics.observe_batch(self.name, sum(p.size for p in parts), waits, elapsed)
        for request, part in taken:
            request.left -= part.size
            if request.future.done():
                continue
            if part.error is not None:
                request.future.set_exception(part.error)
            elif request.left == 0:
                request.future.set_result(None)
