"""The load tester: its multipart bodies and merging as units, then against the real service on a loopback port."""
import asyncio
import json
import time

import aiohttp
import httpx
import pytest
from service_process import free_port, metric, photo_bytes, running_service

from service.loadtest import (BOUNDARY, Share, classify_requests, client_bound, merge, multipart, run_level,
                              run_level_processes, split, table)
from service.loadtest import main as loadtest_main
from service.http.routes.uploads import parse_multipart

MODEL = "shapes-deit"
CHELSEA, COFFEE = ("chelsea.jpg", photo_bytes("chelsea", "JPEG")), ("coffee.jpg", photo_bytes("coffee", "JPEG"))


GRPC_PORT = free_port()


@pytest.fixture(scope="module")
def url():
    with running_service(grpc_port=GRPC_PORT) as base:
        yield base


def served_images(url: str) -> float:
    return metric(httpx.get(f"{url}/metrics").text, "vitserve_images_total", model=MODEL)


def parse_form(body: bytes) -> list[tuple[str, str, bytes]]:
    """(field, filename, bytes) per part, as the service's own multipart parser reads them."""
    return parse_multipart(body, f"multipart/form-data; boundary={BOUNDARY}")


def test_a_multipart_body_reads_back_as_its_files():
    files = [CHELSEA, ('odd "name".png', b"\x89PNG\r\n--not-the-boundary\r\n")]
    parts = parse_form(multipart(files, "files"))
    assert parts == [("files", "chelsea.jpg", CHELSEA[1]), ("files", "odd %22name%22.png", files[1][1])]


class Recorder:
    """Stands in for an aiohttp session: keeps each request's route and arguments, answers 200."""
    status = 200

    def __init__(self):
        self.requests = []

    def post(self, route: str, **kwargs) -> "Recorder":
        self.requests.append((route, kwargs))
        return self

    async def __aenter__(self) -> "Recorder":
        return self

    async def __aexit__(self, *exc) -> None:
        pass

    async def read(self) -> bytes:
        return b""


def sent_forms(files_per_request: int, requests: int) -> tuple[Recorder, list[list[tuple[str, str]]]]:
    """What classify_requests sends over three images: the session, and (field, filename) per part per request."""
    session, images = Recorder(), [CHELSEA, COFFEE, ("rocket.png", b"\x89PNG")]
    send = classify_requests(images, {"model": None, "top_k": 1}, files_per_request)

    async def send_all() -> list[int]:
        return [await send(session, i) for i in range(requests)]

    assert asyncio.run(send_all()) == [200] * requests
    forms = [parse_form(kwargs["data"]) for _, kwargs in session.requests]
    return session, [[(field, name) for field, name, _ in form] for form in forms]


def test_requests_carry_their_images_round_robin_as_file_alone_or_as_files():
    session, forms = sent_forms(files_per_request=1, requests=4)
    assert forms == [[("file", "chelsea.jpg")], [("file", "coffee.jpg")], [("file", "rocket.png")],
                     [("file", "chelsea.jpg")]]
    assert session.requests[0][0] == "/classify" and session.requests[0][1]["params"] == {"top_k": "1"}
    _, forms = sent_forms(files_per_request=2, requests=3)
    assert forms == [[("files", "chelsea.jpg"), ("files", "coffee.jpg")],
                     [("files", "rocket.png"), ("files", "chelsea.jpg")],
                     [("files", "coffee.jpg"), ("files", "rocket.png")]]


def test_client_processes_parts_merge_into_one_level():
    fast, slow = Share([10.0] * 50, {"503": 2}, cpu_s=0.5), Share([30.0] * 50, {"503": 1, "ClientOSError": 4}, 1.9)
    level = merge([fast, slow], concurrency=8, duration=2.0, files_per_request=4)
    assert (level.requests, level.requests_per_s, level.images, level.images_per_s) == (100, 50.0, 400, 200.0)
    assert level.failures == {"503": 3, "ClientOSError": 4}
    assert level.latency_ms["p50"] == 20.0 and level.latency_ms["p90"] == 30.0  # over both processes' samples
    assert (level.client_cpu_s, level.client_cores, level.client_bound) == (2.4, 1.2, True)
    assert "CLIENT-BOUND" in table([level]).splitlines()[1]
    assert "CLIENT-BOUND" not in table([merge([fast, fast], 8, 2.0, 4)])
    assert split(3, 2) == [2, 1] and split(1, 4) == [1] and split(64, 4) == [16] * 4


def test_a_level_is_client_bound_when_any_client_process_nearly_fills_its_core():
    assert client_bound([1.8], seconds=2.0)  # 90% of a core
    assert not client_bound([1.7, 1.7], seconds=2.0)  # 1.7 cores in all, yet neither event loop was saturated
    assert client_bound([0.1, 1.9], seconds=2.0)
    assert not client_bound([], seconds=2.0)


def recorded(send, calls: list[tuple[int, float, float, int]]):
    """`send`, each request's (number, start, end, status) appended to `calls`, on this process's perf_counter
    clock. The load tester reads that clock just before the call (`now`) and just after it returns (`finished`),
    with no await between: a request's `finished` lies between its end here and the next start of its client."""
    async def send_and_record(session, i: int) -> int:
        start = time.perf_counter()
        status = await send(session, i)
        calls.append((i, start, time.perf_counter(), status))
        return status

    return send_and_record


def test_load_tester_counts_the_requests_that_complete_in_its_window(url):
    """What the level reports, against each request as its client saw it. The window opens `warmup` after the level
    starts: after `called`, and before the first request starts. A request counts when its `finished` falls in the
    window, and `finished` lies between its end and its client's next start (the level's return for a client's
    last): so those whose every possible `finished` is in every possible window are counted, and only those with
    one in some window may be. The rate, the latencies and the CPU are of those."""
    duration, warmup, concurrency, calls = 1.5, 0.5, 4, []
    before, cpu_before = served_images(url), time.process_time()
    called = time.perf_counter()
    result = asyncio.run(run_level(url, recorded(classify_requests([CHELSEA], {"model": MODEL}), calls),
                                   concurrency=concurrency, duration=duration, warmup=warmup))
    returned, cpu, served = time.perf_counter(), time.process_time() - cpu_before, served_images(url) - before
    assert {status for *_, status in calls} == {200} and result.failures == {}
    starts, ends = {i: s for i, s, _, _ in calls}, {i: e for i, _, e, _ in calls}  # client k sends k, k + 4, ...
    first = min(starts.values())
    opens, closes = (called + warmup, first + warmup), (called + warmup + duration, first + warmup + duration)
    # each request: (earliest `finished`, latest `finished`, shortest and longest latency the tester can measure)
    spans = {i: (ends[i], starts.get(i + concurrency, returned), ends[i] - starts[i],
                 starts.get(i + concurrency, returned) - ends.get(i - concurrency, called)) for i in starts}
    surely = [i for i, (early, late, *_) in spans.items() if opens[1] <= early and late <= closes[0]]
    maybe = [i for i, (early, late, *_) in spans.items() if opens[0] <= late and early <= closes[1]]
    assert len(surely) <= result.requests <= len(maybe), (len(surely), result.requests, len(maybe))
    assert 0 < result.images == result.requests < len(calls) <= served  # the warm-up's and the tail's: not counted
    assert len(surely) / duration <= result.images_per_s <= len(maybe) / duration
    shortest, longest = min(spans[i][2] for i in maybe) * 1e3, max(spans[i][3] for i in maybe) * 1e3
    assert shortest <= result.latency_ms["p50"] <= result.latency_ms["p99"] <= longest, result.latency_ms
    assert 0 < result.client_cpu_s <= cpu  # this process's CPU, over a part of the run
    assert result.client_cores == result.client_cpu_s / duration
    assert result.client_bound == (result.client_cpu_s >= 0.9 * duration)  # its one event loop's core, nearly full


def test_several_files_per_request_are_all_served_and_counted_as_images(url):
    send = classify_requests([CHELSEA, COFFEE], {"model": MODEL}, files_per_request=3)

    async def one_request() -> int:
        async with aiohttp.ClientSession(url) as session:
            return await send(session, 0)

    before = served_images(url)
    assert asyncio.run(one_request()) == 200 and served_images(url) - before == 3  # one request, three images
    before = served_images(url)
    result = asyncio.run(run_level(url, send, concurrency=2, duration=1.0, warmup=0.3, files_per_request=3))
    served = served_images(url) - before
    assert result.failures == {} and result.requests > 0
    assert result.images == 3 * result.requests and result.images_per_s == 3 * result.requests_per_s
    assert served >= result.images


def test_two_client_processes_count_one_window_together(url):
    before = served_images(url)
    sender = (classify_requests, ([CHELSEA, COFFEE], {"model": MODEL}, 2))
    result = run_level_processes(url, sender, concurrency=3, duration=1.0, processes=2, warmup=0.5, files_per_request=2)
    served = served_images(url) - before
    assert result.failures == {} and 0 < result.images == 2 * result.requests <= served
    assert result.concurrency == 3 and result.latency_ms.keys() == {"p50", "p90", "p95", "p99", "mean"}
    assert 0 < result.latency_ms["p50"] <= result.latency_ms["p99"] and result.client_cores > 0


def test_load_tester_command_line_reports_every_level_as_a_table_json_and_a_plot(url, tmp_path, capsys):
    photo = tmp_path / "coffee.jpg"
    photo.write_bytes(COFFEE[1])
    loadtest_main(["--url", url, "--model", "shapes-vit", "--image", str(photo), "--concurrency", "1,3",
                   "--duration", "1", "--processes", "2", "--files-per-request", "2",
                   "--json", str(tmp_path / "load.json"), "--plot", str(tmp_path / "load.png")])
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:3] == ["concurrency", "images/s", "requests/s"] and "client cores" in header
    assert "CPU ms/image" in header and [r.split()[0] for r in rows] == ["1", "3"]
    levels = json.loads((tmp_path / "load.json").read_text())
    assert [lv["concurrency"] for lv in levels] == [1, 3]
    assert all(lv["images"] == 2 * lv["requests"] > 0 and lv["failures"] == {} and lv["latency_ms"]["p99"] > 0
               and lv["client_cpu_s"] > 0 and lv["client_cores"] > 0 for lv in levels)
    for level, row in zip(levels, rows):  # the table's mark is the JSON's, and each follows the clients' CPU:
        assert level["client_bound"] == row.endswith("CLIENT-BOUND"), (level, row)
        # marked: one of its client processes (two at most) used >= 0.9 of its core over the 1 s, so together
        # >= 0.9; not marked: each used less, so together < 1.8
        assert level["client_cpu_s"] >= 0.9 if level["client_bound"] else level["client_cpu_s"] < 1.8, level
    assert (tmp_path / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("grpc", [False, True])
@pytest.mark.parametrize("datatype", ["FP32", "UINT8"])
def test_load_tester_drives_the_v2_route_or_grpc_with_tensors_of_the_models_input(url, tmp_path, datatype, grpc):
    before = served_images(url)
    over_grpc = ["--grpc", f"127.0.0.1:{GRPC_PORT}"] if grpc else []
    loadtest_main(["--url", url, "--model", MODEL, "--v2", datatype, "--concurrency", "2", "--duration", "1",
                   "--files-per-request", "3", "--json", str(tmp_path / "load.json"), *over_grpc])
    (level,) = json.loads((tmp_path / "load.json").read_text())
    assert level["failures"] == {} and level["images"] == 3 * level["requests"] > 0
    assert served_images(url) - before >= level["images"]
