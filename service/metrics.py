"""Prometheus metrics, Triton-style: requests, images, batch sizes, queue vs compute time, queue depth, decode
time, and the service's own CPU seconds and memory (process_*).

Under the process backend every process writes its metrics to PROMETHEUS_MULTIPROC_DIR (prometheus-client's
multiprocess mode, set by the supervisor before any process starts) and /metrics, on whichever HTTP worker it
lands, adds them all up; process_* then covers the supervisor and all its children.
"""
import os
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def multiprocess() -> bool:
    return "PROMETHEUS_MULTIPROC_DIR" in os.environ


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        if not multiprocess():
            ProcessCollector(registry=r)
        self.requests = Counter("vitserve_requests", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=r)
        self.request_seconds = Histogram("vitserve_request_seconds", "HTTP request latency", ["route"],
                                         buckets=_SECONDS, registry=r)
        self.images = Counter("vitserve_images", "images run through a model's graph", ["model"], registry=r)
        self.batch_size = Histogram("vitserve_batch_size", "images per inference call", ["model"],
                                    buckets=_BATCH, registry=r)
        self.queue_seconds = Histogram("vitserve_queue_seconds", "time a request waited for its first batch to start",
                                       ["model"], buckets=_SECONDS, registry=r)
        self.inference_seconds = Histogram("vitserve_inference_seconds", "compute time of one batch",
                                           ["model"], buckets=_SECONDS, registry=r)
        self.decode_seconds = Histogram("vitserve_decode_seconds", "decode and preprocess time of one image",
                                        buckets=_SECONDS, registry=r)
        self.queue_depth = Gauge("vitserve_queue_depth", "images waiting for a batch", ["model"], registry=r,
                                 multiprocess_mode="livesum")
        self.model_info = Gauge("vitserve_model_info", "served models (value 1): what runs, where",
                                ["model", "version", "architecture", "task", "precision", "provider"], registry=r,
                                multiprocess_mode="livemax")
        self.ready = Gauge("vitserve_model_ready", "1 once the model is loaded and warm", ["model"], registry=r,
                           multiprocess_mode="livemax")
        self.loads = Counter("vitserve_model_loads", "model (re)loads by outcome (ok, failed), start-up's included",
                             ["model", "outcome"], registry=r)
        self.load_seconds = Histogram("vitserve_model_load_seconds", "reading, opening and warming up a model",
                                      ["model"], buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120), registry=r)

    def batch_observer(self, model: str) -> Callable[[int, float], None]:
        """Counts a batch of `model`: (images, inference seconds). The labelled series are looked up once."""
        images, sizes, seconds = (m.labels(model) for m in (self.images, self.batch_size, self.inference_seconds))

        def observe(size: int, inference_s: float) -> None:
            images.inc(size)
            sizes.observe(size)
            seconds.observe(inference_s)

        return observe


def _service_pids() -> list[int]:
    """The supervisor (this worker's parent) and every process it started."""
    parent = os.getppid()
    children = Path(f"/proc/{parent}/task/{parent}/children")
    return [parent, *(int(p) for p in children.read_text().split())] if children.exists() else [os.getpid()]


class ServiceProcesses:
    """process_cpu_seconds_total and process_resident_memory_bytes summed over the service's processes."""

    def collect(self):
        ticks, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
        cpu = rss = 0.0
        for pid in _service_pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # it ended in the meantime
                continue
            cpu += (int(fields[11]) + int(fields[12])) / ticks
            rss += int(fields[21]) * page
        yield CounterMetricFamily("process_cpu_seconds", "CPU seconds of all the service's processes", cpu)
        yield GaugeMetricFamily("process_resident_memory_bytes", "resident memory of all the service's processes",
                                rss)


def exposition(metrics: Metrics) -> bytes:
    """The /metrics body: this process's metrics, or under the process backend every process's, added up."""
    if not multiprocess():
        return generate_latest(metrics.registry)
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    registry.register(ServiceProcesses())
    return generate_latest(registry)
