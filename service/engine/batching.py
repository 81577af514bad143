"""Dynamic batching, one batcher per served graph, with Triton's semantics.

Entries queue up, each the rows of one records array that go together: one HTTP request's images, or under the
process backend a worker's *frame* (the slots of its shared-memory arena that many requests filled). A batch
runs as soon as it holds max_batch_size images or its oldest image has waited max_queue_delay; an entry larger
than the room left is split across batches. Unlike Triton, the batcher knows how many requests are still
decoding their images for this graph (`coming`: the boards of the processes that decode, board.py): a partial
batch waits only while one is, since nothing else could join it, so a lone client never pays the delay. Up to
`concurrency` batches run at once in the executor (2 on a GPU: one is copied in and post-processed while the
other computes); results are written into the entries' records there, and each entry's future is resolved once
all its images are done. Beyond queue_limit queued images, new
entries are refused at once instead of growing the queue. Entries are taken in arrival order within a priority
level, the first level first; one that has waited `aging_s` counts as first-level (urgency.py). Those figures are
the graph's BatchingPolicy: the server's settings, or the model manifest's own, as Triton's model configuration
sets them per model.
"""
import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from repository import ModelEntry
from service.core import tracing
from service.core.errors import ServiceError
from service.core.metrics import Metrics
from service.core.settings import Settings

from .records import Kind, Part, Rows, count, kind_of

ORDER = list(Kind)  # a batch's rows: JPEGs, images, tensors (a text graph's batches are texts alone)

log = logging.getLogger("vitserve")


class QueueFull(Exception):
    """The graph's queue is at its limit."""


@dataclass(eq=False)
class Entry:
    """Rows of one records array in the queue. Its future resolves once every row has its results, to the errors
    of the rows that failed alone ({row: exception}; a JPEG no decoder could read), or fails with the batch."""
    records: np.ndarray
    rows: Rows  # those not yet in a batch
    top_k: int
    inputs: list | None  # one per row not yet in a batch, where its records do not hold it (records.Part)
    future: asyncio.Future
    enqueued: float
    on_taken: Callable[[], None] | None  # called once every row is in a batch that started
    left: int  # rows without results yet
    errors: dict[int, Exception] = field(default_factory=dict)
    batches: set[asyncio.Task] = field(default_factory=set)  # the started batches that hold some of its rows
    traces: list[str | None] = field(default_factory=list)  # its requests' traceparents, where traces are on
    priority: int = 0  # its level, 1 first; 0: the default (the last level)

    @property
    def kind(self) -> Kind:
        return kind_of(self.records)


@dataclass(frozen=True)
class BatchingPolicy:
    """How one graph's requests are batched, as Triton's `dynamic_batching` and queue policy say it per model."""
    max_batch_size: int  # images in a batch at most
    max_queue_delay_s: float  # the longest a partial batch waits for more, while more are on their way
    queue_limit: int  # queued images beyond which requests are refused (503), and the most one request may hold
    aging_s: float = 0.2  # an image that has waited this long is taken as a first-level one (urgency.py)

    @classmethod
    def of(cls, settings: Settings, entry: ModelEntry, model: ModelEntry | None = None) -> "BatchingPolicy":
        """The server's (VITSERVE_MAX_BATCH_SIZE, _MAX_QUEUE_DELAY_MS, _QUEUE_LIMIT, _PRIORITY_AGING_MS), each where
        the graph's manifest does not set its own (its `batching`), nor the manifest of the model it runs for
        (`model`: the fp32 model whose fp16 sibling serves it on CUDA; its manifest is the one a user edits)."""
        own = (model.manifest.get("batching", {}) if model else {}) | entry.manifest.get("batching", {})
        return cls(own.get("max_batch_size", settings.max_batch_size),
                   own.get("max_queue_delay_ms", settings.max_queue_delay_ms) / 1000,
                   own.get("queue_limit", settings.queue_limit), settings.priority_aging_ms / 1000)


# runs one batch in the executor: (parts, each part's queue ms) -> inference seconds
RunBatch = Callable[[list[Part], list[float]], float]


class Batcher:
    def __init__(self, name: str, run: RunBatch, executor: Executor, metrics: Metrics, policy: BatchingPolicy,
                 concurrency: int = 1, coming: Callable[[], int] = lambda: 0,
                 queued: Callable[[], None] = lambda: None):
        """`coming`: how many requests are on their way to this graph (decoding its images), on every board
        (board.py); `queued`:
        called once per turn of the event loop in which the queue changed (the GPU decoder's room is told then)."""
        self.name, self.run, self.executor, self.policy = name, run, executor, policy
        self.coming, self.queued = coming, queued
        self._queue: deque[Entry] = deque()
        self._ranked = 0  # waiting entries of a level above the default: while none, the first is taken first
        self._arrived = asyncio.Event()
        self._slots = asyncio.Semaphore(concurrency)
        self._running: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None
        self._gathering: list[tuple[Entry, Part]] = []  # the batch being gathered
        self.depth = 0  # queued images not yet in a batch
        self.jpegs = 0  # of those, JPEGs to be decoded with their batch (the GPU decoder's backlog)
        self.finished = 0  # batches run to their end (or failure): progress, for the inference process's pulse
        self._depth_gauge = metrics.queue_depth.labels(name)
        self._observe_batch = metrics.batch_observer(name)
        self._depth_told = True  # the gauge shows the depth (set once per turn of the event loop at most)
        # where batches run one at a time (the CPU), a lone request may run in its decode thread (try_run_here)
        self._one_at_a_time = threading.Lock() if concurrency == 1 else None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher-{self.name}")

    async def stop(self) -> None:
        """Stop taking batches; the running ones finish, what still waits is cancelled."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*self._running, return_exceptions=True)
        for entry in self._queue:
            entry.future.cancel()
        self._queue.clear()
        self._ranked = self.jpegs = 0

    def try_run_here(self, records: np.ndarray, top_k: int, trace: str | None = None) -> bool:
        """From a thread of the caller's (a decode thread), the records run at once in that thread, as a batch of
        their own, where nothing else is queued, gathered, running or being decoded for this batcher (the caller's
        own request counts as decoding): a lone request is spared two thread hops. False, having done nothing,
        where the batcher is busy, runs batches two at a time (a GPU), or the records are more than a batch holds:
        then submit them."""
        if (self._one_at_a_time is None or len(records) > self.policy.max_batch_size or self._queue
                or self._gathering or self._running or self.coming() > 1
                or not self._one_at_a_time.acquire(blocking=False)):
            return False
        part = Part(records, slice(0, len(records)), top_k)
        try:
            with tracing.batch_span([trace], len(records), self.name):
                elapsed = self.run([part], [0.0])
        except Exception as e:
            raise self._failed(e, len(records)) from None
        finally:
            self._one_at_a_time.release()
            self.finished += 1
        self._observe_batch(len(records), elapsed)
        if part.errors:  # an image that failed alone fails its request, as Entry's errors do
            raise next(iter(part.errors.values()))
        return True

    def _run_batch(self, parts: list[Part], waits: list[float]) -> float:
        if self._one_at_a_time is None:
            return self.run(parts, waits)
        with self._one_at_a_time:  # after try_run_here's run, if one is under way
            return self.run(parts, waits)

    def _failed(self, error: Exception, images: int) -> ServiceError:
        if isinstance(error, ServiceError):  # the backend's own answer (its device broken): as it is
            return error
        log.exception("%s: a batch of %d images failed", self.name, images)
        return ServiceError(f"inference failed on this request's batch: {type(error).__name__}: {error}",
                            "inference_failed")

    @property
    def busy(self) -> bool:
        """Images queued, being gathered or running."""
        return bool(self._queue or self._gathering or self._running)

    @property
    def room(self) -> int:
        """Images the queue takes before it refuses."""
        return self.policy.queue_limit - self.depth

    def submit(self, records: np.ndarray, top_k: int = 1, inputs: list | None = None, rows: Rows | None = None,
               on_taken: Callable[[], None] | None = None, traces: list[str | None] | None = None,
               priority: int = 0) -> Entry:
        """Queue `rows` of the records (all of them by default; with each row's input where the records do not hold
        it: records.Part); the entry's future resolves once results are written into all of them. `traces`: the
        traceparents of its requests, which the span of each batch that runs it joins (tracing.py); `priority`:
        their level (1 first; 0, the default, last)."""
        rows = slice(0, len(records)) if rows is None else rows
        n = count(rows)
        if n > self.room:
            raise QueueFull(f"{self.name} is busy: {self.depth} images are queued, and this request's {n} would pass "
                            f"its limit of {self.policy.queue_limit}; retry later")
        future = asyncio.get_running_loop().create_future()
        entry = Entry(records, rows, top_k, inputs, future, time.perf_counter(), on_taken, n, traces=traces or [],
                      priority=priority)
        future.add_done_callback(lambda f: f.cancelled() and self._abandon(entry))
        self._queue.append(entry)
        self._ranked += priority > 0
        self._counted(entry, n)
        self._tell_depth()
        self._arrived.set()
        return entry

    def drop(self, entry: Entry, first: int, stop: int) -> None:
        """The entry's rows first..stop-1 leave the queue and the batch being gathered, those not yet in a batch
        that started (their request has gone)."""
        waiting = entry in self._queue
        if waiting:
            entry.rows, entry.inputs, gone = _without(entry.rows, entry.inputs, first, stop)
            self._counted(entry, -gone)
            entry.left -= gone
            self._tell_depth()
        for owner, part in self._gathering:
            if owner is entry:
                part.rows, part.inputs, gone = _without(part.rows, part.inputs, first, stop)
                entry.left -= gone
        if waiting and not count(entry.rows):
            self._leave(entry)
            if entry.on_taken is not None:
                entry.on_taken()
        if not entry.left and not entry.future.done():
            entry.future.set_result(entry.errors)

    def _counted(self, entry: Entry, n: int) -> None:
        """n of the entry's images joined the queue (n < 0: left it, into a batch or with their request)."""
        self.depth += n
        if entry.kind == Kind.JPEG:
            self.jpegs += n

    def _tell_depth(self) -> None:
        """The queue depth gauge, once the current turn of the event loop is over (a gauge shared between processes
        costs a write to shared memory, and a turn may queue many entries)."""
        if self._depth_told:
            self._depth_told = False
            asyncio.get_running_loop().call_soon(self._set_depth_gauge)

    def _set_depth_gauge(self) -> None:
        self._depth_told = True
        self._depth_gauge.set(self.depth)
        self.queued()

    async def settled(self, entry: Entry | None = None) -> None:
        """Every batch started so far has finished (with an entry: every one that holds some of its rows; the
        others write into other records). An entry cancelled before this is awaited has nothing left that writes
        into its records (the batch being gathered leaves it out), so they may be reused: a request cancelled in
        the queue (its client gone, its deadline past) is answered at once, not when the running batch ends."""
        running = self._running if entry is None else entry.batches & self._running
        if running:
            await asyncio.wait(set(running))  # not gather: cancelling the caller must not cancel batches

    async def drained(self) -> None:
        """Nothing is queued, gathered, running or on its way (decoding here or in other processes)."""
        while self._queue or self._gathering or self._running or self.coming():
            await asyncio.sleep(0.005)

    def _abandon(self, entry: Entry) -> None:
        """Its caller went away (the client disconnected): what is not yet in a batch leaves the queue at once."""
        if entry in self._queue:
            self._leave(entry)
            self._counted(entry, -count(entry.rows))
            self._tell_depth()

    def _leave(self, entry: Entry) -> None:
        self._queue.remove(entry)  # (the first, but where priorities chose another)
        self._ranked -= entry.priority > 0

    def _next(self) -> Entry:
        """The waiting entry a batch takes from next: the first to arrive of the first level, an entry that has
        waited aging_s counting as first-level; without priorities, simply the first to arrive."""
        if not self._ranked:
            return self._queue[0]
        aged = time.perf_counter() - self.policy.aging_s
        return min(self._queue, key=lambda e: (1 if e.enqueued <= aged else e.priority or math.inf, e.enqueued))

    async def _gather(self) -> list[tuple[Entry, Part]]:
        """Wait for a first image, then fill up until the batch is full, the first has waited long enough or no
        more images are on their way."""
        taken, room, deadline = self._gathering, self.policy.max_batch_size, None
        while room:
            if self._queue:
                entry = self._next()
                if entry.future.cancelled():  # abandoned, its callback not yet run
                    self._abandon(entry)
                    continue
                deadline = deadline or entry.enqueued + self.policy.max_queue_delay_s
                n = min(room, count(entry.rows))
                rows, entry.rows = _split(entry.rows, n)
                inputs = None
                if entry.inputs is not None:
                    inputs, entry.inputs = entry.inputs[:n], entry.inputs[n:]
                taken.append((entry, Part(entry.records, rows, entry.top_k, inputs)))
                room -= n
                self._counted(entry, -n)
                if not count(entry.rows):
                    self._leave(entry)
                continue
            self._arrived.clear()
            if not taken:
                await self._arrived.wait()
                continue
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or not self.coming():
                break
            try:
                async with asyncio.timeout(remaining):  # (not wait_for: it makes a task each time)
                    await self._arrived.wait()
            except TimeoutError:
                break
        self._gathering = []
        return taken

    async def _loop(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                taken = await self._gather()
            except BaseException:
                self._slots.release()
                raise
            self._tell_depth()
            for entry, _ in taken:
                if entry.on_taken is not None and not count(entry.rows):
                    entry.on_taken()
            taken = [(entry, part) for entry, part in taken if part.size and not entry.future.done()]  # gone meanwhile
            if not taken:
                self._slots.release()
                continue
            task = asyncio.get_running_loop().create_task(self._run(taken))
            for entry, _ in taken:
                entry.batches.add(task)
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, taken: list[tuple[Entry, Part]]) -> None:
        # JPEGs and images first (their rows come back first); parts over the same records side by side, to be
        # gathered and written back as one (records.spans)
        taken.sort(key=lambda t: (ORDER.index(t[1].kind), id(t[1].records)))
        start = time.perf_counter()
        waits = [(start - entry.enqueued) * 1e3 for entry, _ in taken]
        parts = [part for _, part in taken]
        try:
            with tracing.batch_span([tp for entry, _ in taken for tp in entry.traces], sum(p.size for p in parts),
                                    self.name):
                elapsed = await asyncio.get_running_loop().run_in_executor(self.executor, self._run_batch, parts,
                                                                           waits)
        except Exception as e:  # a failed batch fails its entries, not the batcher
            failed = self._failed(e, sum(p.size for p in parts))
            for entry, _ in taken:
                if not entry.future.done():
                    entry.future.set_exception(failed)
            return
        finally:
            self._slots.release()
            self.finished += 1
        if self._queue:  # let the loop start the next batch before it answers this one's entries, so that the
            await asyncio.sleep(0)  # inference thread is not idle while they are encoded
        self._observe_batch(sum(p.size for p in parts), elapsed)
        for entry, part in taken:
            entry.left -= part.size
            entry.errors.update(part.errors)
            if not entry.left and not entry.future.done():
                entry.future.set_result(entry.errors)


def _without(rows: Rows, inputs: list | None, first: int, stop: int) -> tuple[Rows, list | None, int]:
    """The rows outside first..stop-1 (and their inputs), and how many went."""
    numbers = np.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows
    keep = (numbers < first) | (numbers >= stop)
    if keep.all():
        return rows, inputs, 0
    if inputs is not None:
        inputs = [data for data, kept in zip(inputs, keep.tolist()) if kept]
    return numbers[keep], inputs, len(keep) - int(keep.sum())


def _split(rows: Rows, n: int) -> tuple[Rows, Rows]:
    """The first n rows, and the rest."""
    if isinstance(rows, slice):
        return slice(rows.start, rows.start + n), slice(rows.start + n, rows.stop)
    return rows[:n], rows[n:]
