"""Prometheus metrics, Triton-style: requests, images, batch sizes, queue vs compute time, queue depth, decode
time, and the service's own CPU seconds and memory (process_*). Triton's per-model statistics (the statistics
extension, statistics.py) are read off the counters here, and /metrics gives them again under Triton's own
names (nv_inference_*), so a Triton dashboard reads vitserve as it is.

Under the process backend every process writes its metrics to PROMETHEUS_MULTIPROC_DIR (prometheus-client's
multiprocess mode, set by the supervisor before any process starts) and /metrics, on whichever HTTP worker it
lands, adds them all up; process_* then covers the supervisor and all its children.
"""
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class RequestCounter:
    """Counts requests by route, method and status and times them by route, for the HTTP middleware and the gRPC
    service alike; each labelled series is looked up once (a lookup cost more than the write:
    docs/performance.md)."""

    def __init__(self, metrics: "Metrics"):
        self.metrics, self._series = metrics, {}

    def __call__(self, route: str, method: str, status: str, seconds: float) -> None:
        if (series := self._series.get((route, method, status))) is None:
            series = self._series[route, method, status] = (self.metrics.requests.labels(route, method, status),
                                                            self.metrics.request_seconds.labels(route))
        series[0].inc()
        series[1].observe(seconds)


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
        self.images_decoded = Counter("vitserve_images_decoded", "uploads decoded for a model's graph, by where: gpu "
                                      "(JPEGs sent undecoded, decoded with their batch) or cpu (the HTTP process's "
                                      "decode threads)", ["model", "where"], registry=r)
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
        # Triton's statistics: per model version, counted by the process that serves the request (model, version)
        # and per graph and batch size, by the inference thread that runs the batch (model: the graph's key)
        self.model_requests = Counter("vitserve_model_requests", "requests a model version ran, by outcome (success, "
                                      "fail), whatever the route", ["model", "version", "outcome"], registry=r)
        self.model_request_seconds = Counter("vitserve_model_request_seconds", "time those requests took, from "
                                             "reaching the model's pipeline to their results",
                                             ["model", "version", "outcome"], registry=r)
        self.response_cache = Counter("vitserve_response_cache", "uploads looked up in the response cache, by "
                                      "outcome (hit, miss)", ["model", "version", "outcome"], registry=r)
        self.response_cache_seconds = Counter("vitserve_response_cache_seconds", "time those lookups took (hashing "
                                              "the uploads included), shared evenly among them",
                                              ["model", "version", "outcome"], registry=r)
        self.model_inferences = Counter("vitserve_model_inferences", "images (batch rows) run for a model version's "
                                        "successful requests", ["model", "version"], registry=r)
        self.model_phase_seconds = Counter("vitserve_model_phase_seconds", "time successful requests spent in each "
                                           "phase: queue, compute_input, compute_infer, compute_output (a batch's "
                                           "compute counted once for every request in it)",
                                           ["model", "version", "phase"], registry=r)
        self.batches = Counter("vitserve_batches", "inference calls by batch size", ["model", "batch_size"],
                               registry=r)
        self.batch_phase_seconds = Counter("vitserve_batch_phase_seconds", "time inference calls spent gathering "
                                           "their inputs (compute_input), running (compute_infer) and writing "
                                           "results (compute_output), by batch size",
                                           ["model", "batch_size", "phase"], registry=r)
        self.inference_restarts = Counter("vitserve_inference_restarts", "the process backend's inference process "
                                          "started again after it died or hung", registry=r)
        self.last_inference = Gauge("vitserve_last_inference_timestamp_seconds", "when the graph's last batch ran",
                                    ["model"], registry=r, multiprocess_mode="max")

    def batch_observer(self, model: str) -> Callable[[int, float], None]:
        """Counts a batch of `model`: (images, inference seconds). The labelled series are looked up once."""
        images, sizes, seconds = (m.labels(model) for m in (self.images, self.batch_size, self.inference_seconds))

        def observe(size: int, inference_s: float) -> None:
            images.inc(size)
            sizes.observe(size)
            seconds.observe(inference_s)

        return observe

    def phase_observer(self, model: str) -> Callable[[int, tuple[float, float, float]], None]:
        """Counts a batch of graph `model` in Triton's batch statistics: (images, its compute_input, compute_infer
        and compute_output seconds). Each batch size's series are looked up once."""
        series: dict[int, tuple] = {}
        last = self.last_inference.labels(model)

        def observe(size: int, phases: tuple[float, float, float]) -> None:
            if size not in series:
                series[size] = (self.batches.labels(model, str(size)),
                                *(self.batch_phase_seconds.labels(model, str(size), p) for p in COMPUTE))
            count, *seconds = series[size]
            count.inc()
            for counter, s in zip(seconds, phases):
                counter.inc(s)
            last.set(time.time())

        return observe

    def request_observer(self, model: str, version: str) -> "RequestObserver":
        return RequestObserver(self, model, version)


COMPUTE = ("compute_input", "compute_infer", "compute_output")
PHASES = ("queue", *COMPUTE)
# the records' timing fields (records.TIMINGS) of each phase
PHASE_FIELDS = {"queue": "queue_ms", "compute_input": "input_ms", "compute_infer": "inference_ms",
                "compute_output": "output_ms"}


class RequestObserver:
    """Counts one model version's requests in Triton's request statistics; the labelled series looked up once."""

    def __init__(self, metrics: Metrics, model: str, version: str):
        self._count = {o: metrics.model_requests.labels(model, version, o) for o in ("success", "fail")}
        self._seconds = {o: metrics.model_request_seconds.labels(model, version, o) for o in ("success", "fail")}
        self._rows = metrics.model_inferences.labels(model, version)
        self._phases = [(metrics.model_phase_seconds.labels(model, version, p), PHASE_FIELDS[p]) for p in PHASES]
        self._cache = {o: (metrics.response_cache.labels(model, version, o),
                           metrics.response_cache_seconds.labels(model, version, o)) for o in ("hit", "miss")}

    def looked_up(self, hits: int, misses: int, seconds: float) -> None:
        """A request's uploads looked up in the response cache."""
        for outcome, n in (("hit", hits), ("miss", misses)):
            if n:
                count, time_spent = self._cache[outcome]
                count.inc(n)
                time_spent.inc(seconds * n / (hits + misses))

    def failed(self, seconds: float) -> None:
        self._count["fail"].inc()
        self._seconds["fail"].inc(seconds)

    def succeeded(self, seconds: float, fields: dict[str, np.ndarray]) -> None:
        """`fields`: the request's results by record field; its first row's timings are its batch's."""
        self._count["success"].inc()
        self._seconds["success"].inc(seconds)
        rows = len(fields.get("queue_ms", ()))
        if rows:
            self._rows.inc(rows)
            for counter, name in self._phases:
                counter.inc(float(fields[name][0]) / 1e3)


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


def collected(metrics: Metrics) -> list[Metric]:
    """Every metric family: this process's, or under the process backend every process's, added up, with
    process_* covering them all."""
    if not multiprocess():
        return list(metrics.registry.collect())
    return [*MultiProcessCollector(None).collect(), *ServiceProcesses().collect()]


class _Families:
    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def exposition(families: list[Metric]) -> bytes:
    """Metric families in Prometheus' text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)
