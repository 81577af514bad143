"""OpenTelemetry traces (service/core/tracing.py) out of a real service on both backends, into a real OTLP/HTTP receiver
on loopback that this test starts and that decodes what it gets with opentelemetry-proto: the caller's trace goes on
through the request's span, its decode, its wait in the queue and the batch that ran it (made in the inference
process under the process backend)."""
import socket
import time

import httpx
import pytest
import tritonclient.grpc as triton_grpc
from service_process import (ROOT, free_port, model_pixels, otlp_receiver, photo_bytes, running_service,
                             service_and_process)

CALLER_TRACE, CALLER_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


def spans_of(spans: list, trace: str, names: set[str], timeout_s: float = 60) -> dict:
    """The trace's spans by name once every one of `names` has come (a liveness bound, not a measurement)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = {s.name: s for s in list(spans) if s.trace_id.hex() == trace}
        if names <= found.keys():
            return found
        assert time.monotonic() < deadline, f"spans {sorted(names - found.keys())} never came; got {sorted(found)}"
        time.sleep(0.05)


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_a_callers_trace_comes_back_out_of_the_exporter_with_the_services_spans_under_it(backend, monkeypatch):
    with otlp_receiver() as (endpoint, spans):
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # ms: the batch processor sends soon
        settings = {"workers": 1} if backend == "process" else {}
        with running_service(backend=backend, **settings) as url:
            answer = httpx.post(f"{url}/classify", files={"file": ("cat.jpg", photo_bytes("chelsea", "JPEG"))},
                                headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}, timeout=60)
            assert answer.status_code == 200, answer.text
            # under the process backend every request waits in the inference process's queue; under the thread
            # backend a lone request runs in its decode thread, with no queue to wait in
            names = {"POST /classify", "decode", "batch"} | ({"queue"} if backend == "process" else set())
            found = spans_of(spans, CALLER_TRACE, names)
        request = found["POST /classify"]
        assert request.parent_span_id.hex() == CALLER_SPAN
        assert {a.key: a.value.int_value for a in request.attributes}["http.response.status_code"] == 200
        for child in names - {"POST /classify"}:
            assert found[child].parent_span_id == request.span_id, child
        batch = found["batch"]
        assert [link.span_id for link in batch.links] == [request.span_id]
        assert {a.key: a.value.int_value for a in batch.attributes}["vitserve.batch_size"] == 1


def test_a_grpc_callers_trace_goes_on_through_model_infer(monkeypatch):
    with otlp_receiver() as (endpoint, spans):
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        port = free_port()
        with running_service(backend="process", workers=1, grpc_port=port):
            pixels = model_pixels(ROOT / "model_repository" / "shapes-vit", photo_bytes("chelsea", "JPEG"))
            with triton_grpc.InferenceServerClient(f"127.0.0.1:{port}") as client:
                images = triton_grpc.InferInput("images", [1, *pixels.shape], "UINT8")
                images.set_data_from_numpy(pixels[None])
                client.infer("shapes-vit", [images], headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
            found = spans_of(spans, CALLER_TRACE, {"gRPC ModelInfer", "queue", "batch"})
        call = found["gRPC ModelInfer"]
        assert call.parent_span_id.hex() == CALLER_SPAN
        assert found["queue"].parent_span_id == found["batch"].parent_span_id == call.span_id


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_sigterm_ends_the_service_soon_while_its_collector_takes_spans_and_never_answers(backend, monkeypatch):
    """A listening socket that accepts nothing: the kernel completes the exporter's connections and keeps what it
    sends, and no answer ever comes. The spans still batched are dropped after tracing.SHUTDOWN_S in each process;
    the SDK's own shutdown took 19-20 s here on either backend, each export waiting its 10 s timeout."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as silent:
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # ms: the exporter is soon stuck in a send
        settings = {"workers": 1} if backend == "process" else {}
        with service_and_process(backend=backend, **settings) as (url, proc):
            for _ in range(3):
                answer = httpx.post(f"{url}/classify", files={"file": ("cat.jpg", photo_bytes("chelsea", "JPEG"))},
                                    timeout=60)
                assert answer.status_code == 200, answer.text
            start = time.monotonic()
            proc.terminate()
            proc.wait(60)
            took = time.monotonic() - start
    assert proc.returncode == 0 and took < 10, (proc.returncode, took)  # here: 2.2 s thread, 4.5 s process


def test_traces_are_off_unless_asked_and_cost_no_span(monkeypatch):
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    from service.core import tracing
    tracing.enable("http")
    assert not tracing.on() and tracing.traceparent() is None
    assert tracing.span("decode") is tracing.batch_span(["00-x-y-01"], 1, "m")  # one shared no-op
