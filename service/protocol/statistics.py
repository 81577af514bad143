"""Triton's statistics extension, read off the service's own Prometheus counters (metrics.py): per model version, its
requests by outcome, their queue and compute times, its inferences and executions, and per batch size the compute
of its graph's batches. The same figures go into /metrics under Triton's names (nv_inference_*), so the two can
never disagree: under the process backend both add up every process's counts (the HTTP workers count requests,
the inference process batches).

Durations are Triton's: `success.ns` the requests' time from reaching their model's pipeline (decoded, or parsed)
to their results; `queue` the wait for their first batch; `compute_*` their batch's gathering of inputs (and GPU
decoding), run and writing of results, counted once per request in it, so that ns / count is a request's mean.
A model whose graph serves another name too (an fp32 model run by its fp16 sibling on CUDA) shares its executions
and batch figures with that name.
"""
from collections import defaultdict
from collections.abc import Iterable

from prometheus_client.metrics_core import Metric

from service.core.errors import NotFound
from service.core.metrics import COMPUTE, PHASES, Metrics, collected, exposition
from service.pipeline.pipeline import Pipeline
from service.pipeline.served import Pipelines


class Readings:
    """Samples by name, for sums over the samples whose labels match."""

    def __init__(self, families: Iterable[Metric]):
        self._by_name: dict[str, list[tuple[dict, float]]] = defaultdict(list)
        for family in families:
            for sample in family.samples:
                self._by_name[sample.name].append((sample.labels, sample.value))

    def _matching(self, name: str, labels: dict[str, str]) -> list[tuple[dict, float]]:
        return [(got, value) for got, value in self._by_name.get(name, ())
                if all(got.get(k) == v for k, v in labels.items())]

    def total(self, name: str, **labels: str) -> float:
        return sum(value for _, value in self._matching(name, labels))

    def most(self, name: str, **labels: str) -> float:
        return max((value for _, value in self._matching(name, labels)), default=0.0)

    def label_values(self, name: str, label: str, **labels: str) -> set[str]:
        return {got[label] for got, _ in self._matching(name, labels) if label in got}


def _duration(count: float, seconds: float) -> dict:
    return {"count": int(count), "ns": int(seconds * 1e9)}


def model_statistics(readings: Readings, pipeline: Pipeline, graph: str) -> dict:
    """One model version's statistics in Triton's schema (its JSON form); `graph`: the key of the graph serving it."""
    labels = {"model": pipeline.name, "version": str(pipeline.entry.version)}
    outcome = {o: _duration(readings.total("vitserve_model_requests_total", outcome=o, **labels),
                            readings.total("vitserve_model_request_seconds_total", outcome=o, **labels))
               for o in ("success", "fail")}
    served = outcome["success"]["count"]
    phases = {p: _duration(served, readings.total("vitserve_model_phase_seconds_total", phase=p, **labels))
              for p in PHASES}
    sizes = sorted(readings.label_values("vitserve_batches_total", "batch_size", model=graph), key=int)
    batches = [{"batch_size": int(size), **{p: _duration(
        readings.total("vitserve_batches_total", model=graph, batch_size=size),
        readings.total("vitserve_batch_phase_seconds_total", model=graph, batch_size=size, phase=p))
        for p in COMPUTE}} for size in sizes]
    return {
        "name": pipeline.name, "version": labels["version"],
        "last_inference": int(readings.most("vitserve_last_inference_timestamp_seconds", model=graph) * 1e3),
        "inference_count": int(readings.total("vitserve_model_inferences_total", **labels)),
        "execution_count": int(readings.total("vitserve_batches_total", model=graph)),
        "inference_stats": {**outcome, **phases, **{f"cache_{o}": _duration(
            readings.total("vitserve_response_cache_total", outcome=o, **labels),
            readings.total("vitserve_response_cache_seconds_total", outcome=o, **labels)) for o in ("hit", "miss")}},
        "batch_stats": batches,
    }


def current_statistics(metrics: Metrics, pipelines: Pipelines, name: str, version: str | None) -> list[dict]:
    """The statistics route's answer (REST and gRPC): served_statistics of the metrics as they are now."""
    return served_statistics(Readings(collected(metrics)), pipelines, name, version)


def served_statistics(readings: Readings, pipelines: Pipelines, name: str | None = None,
                      version: str | None = None) -> list[dict]:
    """The statistics of every model version served (or loading), of a model's versions, or of one version, by
    name and version; NotFound for a model or version not served."""
    chosen = sorted(pipelines.every(), key=lambda p: (p.name, p.entry.version))
    if name:
        chosen = [p for p in chosen if p.name == name and (not version or str(p.entry.version) == version)]
        if not chosen:
            raise NotFound(f"no model {name!r}" + (f" version {version}" if version else ""), "model_not_found")
    status = pipelines.backend.status()
    return [model_statistics(readings, p, status[p.key].graph or p.key) for p in chosen]


# Triton's metric names for the statistics: (name, help, type, value of a model's statistics)
TRITON_METRICS = [
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes", "counter",
     lambda s: s["inference_stats"]["success"]["count"]),
    ("nv_inference_request_failure", "Number of failed inference requests, all batch sizes", "counter",
     lambda s: s["inference_stats"]["fail"]["count"]),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)", "counter",
     lambda s: s["inference_count"]),
    ("nv_inference_exec_count", "Number of model executions performed (does not include cached requests)",
     "counter", lambda s: s["execution_count"]),
    ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds", "counter",
     lambda s: (s["inference_stats"]["success"]["ns"] + s["inference_stats"]["fail"]["ns"]) // 1000),
    *((f"nv_inference_{phase}_duration_us", f"Cumulative {phase.replace('_', ' ')} duration in microseconds",
       "counter", lambda s, phase=phase: s["inference_stats"][phase]["ns"] // 1000) for phase in PHASES),
    ("nv_cache_num_hits_per_model", "Number of cache hits per model", "counter",
     lambda s: s["inference_stats"]["cache_hit"]["count"]),
    ("nv_cache_num_misses_per_model", "Number of cache misses per model", "counter",
     lambda s: s["inference_stats"]["cache_miss"]["count"]),
    ("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in microseconds", "counter",
     lambda s: s["inference_stats"]["cache_hit"]["ns"] // 1000),
    ("nv_cache_miss_duration_per_model", "Total cache miss (lookup) duration per model, in microseconds", "counter",
     lambda s: s["inference_stats"]["cache_miss"]["ns"] // 1000),
]


def triton_exposition(stats: list[dict], pending: dict[tuple[str, str], float]) -> bytes:
    """The statistics as Triton's /metrics gives them, in Prometheus' text format: its names, labels model and
    version, counters without a _total suffix (prometheus-client would add one), and the requests pending per
    model (`pending`, by (name, version))."""
    lines = []
    for name, doc, kind, value in TRITON_METRICS:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        lines += [f"{name}{_labels(s['name'], s['version'])} {value(s)}" for s in stats]
    name = "nv_inference_pending_request_count"
    lines += [f"# HELP {name} Instantaneous number of pending requests awaiting execution per-model.",
              f"# TYPE {name} gauge"]
    lines += [f"{name}{_labels(s['name'], s['version'])} {pending.get((s['name'], s['version']), 0.0):g}"
              for s in stats]
    return ("\n".join(lines) + "\n").encode()


def metrics_page(metrics: Metrics, pipelines: Pipelines) -> bytes:
    """The /metrics body: the service's metrics (every process's, added up), then Triton's names for the
    statistics, computed from the same readings."""
    families = collected(metrics)
    readings = Readings(families)
    stats = served_statistics(readings, pipelines)
    status = pipelines.backend.status()
    pending = {(p.name, str(p.entry.version)): readings.total("vitserve_queue_depth",
                                                              model=status[p.key].graph or p.key)
               for p in pipelines.every()}
    return exposition(families) + triton_exposition(stats, pending)


def _labels(model: str, version: str) -> str:
    escape = lambda v: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # noqa: E731
    return f'{{model="{escape(model)}",version="{escape(version)}"}}'
