"""Dynamic batching, one batcher per model, with Triton's semantics.

Images queue up; a batch runs as soon as it holds max_batch_size images or its oldest image has waited
max_queue_delay. While a batch runs (in the inference thread, off the event loop) the next one gathers, so
under load batches fill without waiting at all. Unlike Triton, the batcher knows which requests are still
decoding their images for this model (`preparing`): a partial batch waits only while one is, since nothing
else could join it, so a lone client never pays the delay. Each image's row of every output goes back to its request.
Beyond queue_limit queued images, new requests are refused at once instead of growing the queue.
"""
import asyncio
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .metrics import Metrics


class QueueFull(Exception):
    """The model's queue is at its limit."""


@dataclass
class Result:
    outputs: dict[str, np.ndarray]  # this image's row of every output
    queue_s: float
    inference_s: float
    batch_size: int


@dataclass
class _Item:
    x: np.ndarray
    future: asyncio.Future
    enqueued: float


class Batcher:
    def __init__(self, model: str, run: Callable[[np.ndarray], dict[str, np.ndarray]], executor: Executor,
                 metrics: Metrics, max_batch_size: int, max_queue_delay_s: float, queue_limit: int):
        self.model, self.run, self.executor, self.metrics = model, run, executor, metrics
        self.max_batch_size, self.max_queue_delay_s, self.queue_limit = max_batch_size, max_queue_delay_s, queue_limit
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._preparing = 0  # requests decoding images that will come to this batcher

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher-{self.model}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        while not self._queue.empty():
            self._queue.get_nowait().future.cancel()

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    @contextmanager
    def preparing(self) -> Iterator[None]:
        """Around a request's decoding: while it runs, a partial batch may wait (up to the delay) for its images."""
        self._preparing += 1
        try:
            yield
        finally:
            self._preparing -= 1

    def submit(self, images: list[np.ndarray]) -> list[asyncio.Future]:
        """Queue the images (each [3, H, W]) and return one future per image; all or none are queued."""
        if self.depth + len(images) > self.queue_limit:
            raise QueueFull(f"{self.model} has {self.depth} images queued; the limit is {self.queue_limit}")
        loop, now = asyncio.get_running_loop(), time.perf_counter()
        futures = []
        for x in images:
            item = _Item(x, loop.create_future(), now)
            self._queue.put_nowait(item)
            futures.append(item.future)
        self.metrics.queue_depth.labels(self.model).set(self.depth)
        return futures

    async def _gather(self) -> list[_Item]:
        """Wait for a first image, then fill up until the batch is full, the first has waited long enough or no
        more images are on their way."""
        first = await self._queue.get()
        batch, deadline = [first], first.enqueued + self.max_queue_delay_s
        while len(batch) < self.max_batch_size:
            if not self._queue.empty():
                batch.append(self._queue.get_nowait())
                continue
            remaining = deadline - time.perf_counter()
            if remaining <= 0 or not self._preparing:
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), remaining))
            except TimeoutError:
                break
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [item for item in await self._gather() if not item.future.done()]  # drop abandoned requests
            self.metrics.queue_depth.labels(self.model).set(self.depth)
            if not batch:
                continue
            start = time.perf_counter()
            try:
                outputs = await loop.run_in_executor(self.executor, self.run, np.stack([i.x for i in batch]))
            except Exception as e:  # a failed batch fails its requests, not the batcher
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(e)
                continue
            elapsed = time.perf_counter() - start
            self.metrics.observe_batch(self.model, len(batch), [start - i.enqueued for i in batch], elapsed)
            for row, item in enumerate(batch):
                if not item.future.done():
                    item.future.set_result(Result({k: v[row] for k, v in outputs.items()},
                                                  start - item.enqueued, elapsed, len(batch)))
