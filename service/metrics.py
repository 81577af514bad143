"""Prometheus metrics, Triton-style: requests, images, batch sizes, queue vs compute time, queue depth, and the
process's own CPU seconds and memory (process_*)."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        self.requests = Counter("vitserve_requests", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=r)
        self.request_seconds = Histogram("vitserve_request_seconds", "HTTP request latency", ["route"],
                                         buckets=_SECONDS, registry=r)
        self.images = Counter("vitserve_images", "images run through a model", ["model"], registry=r)
        self.batch_size = Histogram("vitserve_batch_size", "images per inference call", ["model"],
                                    buckets=_BATCH, registry=r)
        self.queue_seconds = Histogram("vitserve_queue_seconds", "time an image waited for its batch to start",
                                       ["model"], buckets=_SECONDS, registry=r)
        self.inference_seconds = Histogram("vitserve_inference_seconds", "compute time of one batch",
                                           ["model"], buckets=_SECONDS, registry=r)
        self.decode_seconds = Histogram("vitserve_decode_seconds", "decode and preprocess time of one image",
                                        buckets=_SECONDS, registry=r)
        self.queue_depth = Gauge("vitserve_queue_depth", "images waiting for a batch", ["model"], registry=r)
        self.model_info = Gauge("vitserve_model_info", "served models (value 1)",
                                ["model", "architecture", "task", "precision", "provider"], registry=r)
        self.ready = Gauge("vitserve_model_ready", "1 once the model is loaded and warm", ["model"], registry=r)

    def observe_batch(self, model: str, size: int, waits: list[float], inference_s: float) -> None:
        self.images.labels(model).inc(size)
        self.batch_size.labels(model).observe(size)
        self.inference_seconds.labels(model).observe(inference_s)
        for wait in waits:
            self.queue_seconds.labels(model).observe(wait)
