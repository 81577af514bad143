"""OpenTelemetry traces, off unless the standard variables ask for them: OTEL_TRACES_EXPORTER=otlp, with
OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), OTLP over HTTP/protobuf; OTEL_SERVICE_NAME and
OTEL_RESOURCE_ATTRIBUTES as everywhere. Off, nothing of OpenTelemetry is imported and each hook below is one test
of a module global: the request path pays nothing (docs/performance.md).

A request's spans: the request itself (a W3C `traceparent` header continues the caller's trace), its decode (the
wait for a decode thread included), its wait in the queue, and the batch that ran it, with its size. A batch holds
many requests: its span is linked to each of them, and is the child of its first one's, so that it joins that
trace; under the process backend it is made in the inference process from the requests' `traceparent`s, which
travel with the worker's frame.
"""
import logging
import os
import threading
from contextlib import AbstractContextManager, nullcontext
from typing import Any

log = logging.getLogger("vitserve")

_tracer: Any = None  # an opentelemetry Tracer, where traces are on
_provider: Any = None  # its TracerProvider, which shut_down ends
_OFF = nullcontext()
# How long the spans still batched at shutdown may take to go out. The SDK's own shutdown waits 30 s for its worker,
# whose exports each wait the exporter's 10 s: a collector that accepts and never answers held an idle server's exit
# 20-30 s after SIGTERM, the whole of Kubernetes' default grace (issue 65).
SHUTDOWN_S = 2.0


def enable(role: str) -> None:
    """Traces on in this process, where OTEL_TRACES_EXPORTER asks for OTLP; `role`: which of the service's
    processes this is (vitserve.role)."""
    global _tracer, _provider
    if "otlp" not in os.environ.get("OTEL_TRACES_EXPORTER", "").split(","):
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    _provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                                                        "vitserve"),
                                                         "vitserve.role": role}),
                               shutdown_on_exit=False)  # (shut_down's bounded wait instead of its atexit one)
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _tracer = _provider.get_tracer("vitserve")


def shut_down(seconds: float = SHUTDOWN_S) -> None:
    """At the process's end: the spans still batched go out within `seconds`, or are dropped, and the log says so
    (a no-op where traces are off)."""
    global _provider
    provider, _provider = _provider, None
    if provider is None:
        return
    ending = threading.Thread(target=provider.shutdown, name="trace-shutdown", daemon=True)
    ending.start()
    ending.join(seconds)
    if ending.is_alive():  # (its daemon threads end with the process)
        log.warning("traces: the spans still batched did not reach the collector within %gs of shutdown; dropped",
                    seconds)


def on() -> bool:
    return _tracer is not None


def request_span(method: str, path: str, headers: dict[str, str]) -> AbstractContextManager:
    """The request's server span, the current span of its task, in the caller's trace where it sent one."""
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = TraceContextTextMapPropagator().extract(headers)
    return _tracer.start_as_current_span(f"{method} {path}", context=context, kind=SpanKind.SERVER,
                                         attributes={"http.request.method": method, "url.path": path})


def call_span(method: str, metadata) -> AbstractContextManager:
    """A gRPC call's server span, in the caller's trace where its metadata carries a traceparent (a no-op where
    traces are off)."""
    if _tracer is None:
        return _OFF
    return request_span("gRPC", method, {key: value for key, value in metadata
                                         if key in ("traceparent", "tracestate")})


def span(name: str, **attributes) -> AbstractContextManager:
    """A child of the current span (a no-op where traces are off)."""
    return _OFF if _tracer is None else _tracer.start_as_current_span(name, attributes=attributes)


def past_span(name: str, start_ns: int, seconds: float, **attributes) -> None:
    """A child of the current span, for something already over that began at `start_ns` (time.time_ns())."""
    if _tracer is not None:
        _tracer.start_span(name, start_time=start_ns, attributes=attributes).end(start_ns + int(seconds * 1e9))


def traceparent() -> str | None:
    """The current span as a W3C traceparent, to hand to the thread or process that runs the request's batch."""
    if _tracer is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent")


def batch_span(traceparents: list[str | None], size: int, model: str) -> AbstractContextManager:
    """A batch's span: the child of its first request's, linked to every request in it."""
    given = [tp for tp in traceparents if tp]
    if _tracer is None or not given:
        return _OFF
    from opentelemetry.trace import Link, get_current_span
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    contexts = [TraceContextTextMapPropagator().extract({"traceparent": tp}) for tp in given]
    links = [Link(get_current_span(context).get_span_context()) for context in contexts]
    return _tracer.start_as_current_span("batch", context=contexts[0], links=links,
                                         attributes={"vitserve.batch_size": size, "vitserve.model": model})
