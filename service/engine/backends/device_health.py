"""Whether the device still runs batches: a failed batch narrowed down to the images that fail, and batches that
fail whole counted until the process is judged broken.

A poisoned CUDA context (an illegal memory access, an ECC error) leaves the process alive, its event loop ticking
and its batches "finishing", each with an error: only a new process recovers. An image whose input makes ONNX
Runtime fail is no such fault, and must not cost the other requests of its batch their answers, nor count
against the device. So a batch that fails is run again in halves, down to single images (`run_isolating`): the
images that fail alone fail their own requests, and a batch of which any image ran counts as one that ran. Only
batches of which nothing ran count (`DeviceHealth`): VITSERVE_DEVICE_BROKEN_BATCHES of them in a row, the first at
least VITSERVE_DEVICE_BROKEN_S before the last, and the process stops (BROKEN_EXIT_STATUS), for the supervisor
or the orchestrator to start another.
"""
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

log = logging.getLogger("vitserve")

BROKEN_EXIT_STATUS = 75  # (EX_TEMPFAIL) a process whose device failed every batch: a new process may serve

RunBatch = Callable[[np.ndarray, np.ndarray], dict[str, np.ndarray]]  # Runner.run: (images, pixel_values) -> outputs


def run_isolating(run: RunBatch, images, pixel_values: np.ndarray) -> tuple[dict[str, np.ndarray],
                                                                               dict[int, Exception]]:
    """The batch's outputs, and the errors of the rows (images first, then pixel_values) that failed alone, whose
    rows of the outputs are zeros. A batch that fails is run again in halves, each half that fails in halves
    again, down to single rows: at most 2n - 2 more runs, only when one failed. Raises the batch's error where no
    row ran."""
    try:
        return run(images, pixel_values), {}
    except Exception as error:  # ONNX Runtime's errors derive from Exception alone
        first = error
    n_images, n = len(images), len(images) + len(pixel_values)
    outputs: dict[str, np.ndarray] = {}
    failed: dict[int, Exception] = {}

    def attempt(start: int, stop: int) -> None:
        try:
            got = run(images[start:min(stop, n_images)],
                      pixel_values[max(start - n_images, 0):max(stop - n_images, 0)])
        except Exception as error:
            if stop - start == 1:
                failed[start] = error
                return
            middle = (start + stop) // 2
            attempt(start, middle)
            attempt(middle, stop)
            return
        for name, value in got.items():
            if name not in outputs:
                outputs[name] = np.zeros((n, *value.shape[1:]), value.dtype)
            outputs[name][start:stop] = value

    if n > 1:
        attempt(0, n // 2)
        attempt(n // 2, n)
    if not outputs:
        raise first
    log.warning("a batch of %d images failed (%s: %s); run again in parts, %d of its images failed alone", n,
                type(first).__name__, first, len(failed))
    return outputs, failed


class DeviceHealth:
    """Counts the batches in a row of which no image ran; one that ran resets the count. `batches` such batches,
    the first `span_s` or more before the last, and the device is broken: `on_broken` is called once, with why.
    Batches finish on several inference threads, hence the lock."""

    def __init__(self, batches: int, span_s: float, on_broken: Callable[[str], None]):
        self.batches, self.span_s, self.on_broken = batches, span_s, on_broken
        self.failures, self.first_failure = 0, 0.0
        self.broken: str | None = None
        self._lock = threading.Lock()

    def ran(self) -> None:
        with self._lock:
            self.failures = 0

    def failed(self, error: Exception) -> None:
        with self._lock:
            now = time.monotonic()
            if not self.failures:
                self.first_failure = now
            self.failures += 1
            if (self.broken or not self.batches or self.failures < self.batches
                    or now - self.first_failure < self.span_s):
                return
            self.broken = (f"the device failed {self.failures} batches in a row over {now - self.first_failure:.1f}s, "
                           f"the last with {type(error).__name__}: {error}")
        log.error("%s; stopping, for a new process to serve", self.broken)
        self.on_broken(self.broken)
