"""Triton's perf_analyzer, unchanged (tritonclient 2.40.0's binary: bench/perf_analyzer.py, `make perf-analyzer`),
against the real service on the process backend: HTTP and gRPC, sync, async and gRPC's stream, batches of 1 and 8,
tensors in the body and in system shared memory. Each run reads the model's configuration and the server's
statistics, and must report the server's queue and compute times; it skips, saying why, where perf_analyzer cannot
start (it needs Debian's libb64-0d: .ci/run installs it)."""
import pytest
from service_process import ROOT, free_port, model_pixels, photo_bytes, running_service

from bench.perf_analyzer import input_data, run, why_not

pytestmark = pytest.mark.skipif(why_not() is not None, reason=str(why_not()))
MODEL = "shapes-deit"
MEASURE = ("--concurrency-range", "2", "--measurement-mode", "count_windows", "--measurement-request-count", "20",
           "-s", "1000", "-r", "3")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the HTTP address, the gRPC address, perf_analyzer's --input-data file of one real photo's pixels)."""
    pixels = model_pixels(ROOT / "model_repository" / MODEL, photo_bytes("chelsea", "JPEG"))
    data = input_data(pixels, tmp_path_factory.mktemp("perf") / "chelsea.json")
    grpc_port = free_port()
    with running_service(backend="process", workers=2, grpc_port=grpc_port, max_batch_size=16, queue_limit=64,
                         access_log="false") as url:
        yield url.removeprefix("http://"), f"127.0.0.1:{grpc_port}", data


@pytest.mark.parametrize("protocol, mode, batch, memory", [
    ("http", "sync", 1, None),  # as a user first types it: its own random data
    ("http", "async", 8, "system"),
    ("grpc", "sync", 8, None),
    ("grpc", "async", 1, "system"),
    ("grpc", "streaming", 8, "system"),
])
def test_perf_analyzer_measures_the_service_as_it_measures_triton(served, protocol, mode, batch, memory):
    http, grpc, data = served
    options = ["-i", protocol, "-b", str(batch), *MEASURE]
    options += {"sync": [], "async": ["--async"], "streaming": ["--streaming"]}[mode]
    options += ["--shared-memory", memory, "--input-data", str(data)] if memory else []
    report = run(MODEL, grpc if protocol == "grpc" else http, *options)
    assert report.inferences_per_s > 0
    for part in ("Queue", "Compute Input", "Compute Infer", "Compute Output"):
        assert report.server_us(part) > 0, (part, report.output)
    # the server's own counts, as perf_analyzer read them from the statistics: `batch` images a request
    server = report.output[report.output.index("Server:"):]
    inferences, executions, requests = (int(server.split(f"{label}: ")[1].split()[0])
                                        for label in ("Inference count", "Execution count", "Successful request count"))
    assert inferences == batch * requests and 0 < executions <= requests + 2, server  # (2: batches at the edges)
    assert "Unable" not in report.output and "error" not in report.output.lower(), report.output
