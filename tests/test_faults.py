"""Faults against a real server: a graph that does not match its manifest's sha256 and a graph that ONNX Runtime
cannot load are reported in /models with the reason, and the other models serve; a batch that ONNX Runtime fails
on fails only its own requests; clients that go away mid-upload or mid-queue leave nothing behind. And on the
process backend, under load from real clients: its inference process killed (replaced in place, 503s meanwhile,
never a refused connection), hung (unready, then replaced), killed too often (the service exits 1); an HTTP worker
killed; and request heads that never come whole (closed after the header timeout) on both backends."""
import http.client
import json
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from fault_graphs import fragile, stalling
from prometheus_client.parser import text_string_to_metric_families
from service_process import (ROOT, connections_to_every_worker, direct_probabilities, leave_mid_request, metric,
                             photo_bytes, process_metrics, role_pids, running_service, service_and_process)

from repository import sha256
from service.engine.backends.heartbeat import HEARTBEAT, Heartbeat
from service.supervisor import Crashes

JPEG = photo_bytes("chelsea", "JPEG")
DARK, BRIGHT = photo_bytes("coffee", "JPEG"), photo_bytes("astronaut", "JPEG")  # top-left pixel 40 / 177 as input


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    repo = tmp_path_factory.mktemp("faulty-repository")
    for name in ("shapes-vit", "shapes-deit", "shapes-swin"):
        shutil.copytree(ROOT / "model_repository" / name, repo / name)
    tampered = repo / "shapes-deit" / "model.onnx"  # one byte changed after export
    data = bytearray(tampered.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tampered.write_bytes(bytes(data))
    broken = repo / "shapes-swin"  # not ONNX at all, though its manifest vouches for it
    (broken / "model.onnx").write_bytes(b"this is not an ONNX graph")
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["files"]["model"].update(sha256=sha256(broken / "model.onnx"), bytes=25)
    (broken / "manifest.json").write_text(json.dumps(manifest))
    fragile(ROOT / "model_repository" / "shapes-vit", repo / "shapes-vit-fragile")
    (repo / "notes").mkdir()  # a stray folder: listed with why
    (repo / ".cache").mkdir()  # a hidden one: not a candidate
    # readiness relaxed to "one serves" (strict, the default, says not ready here: tests/test_readiness.py)
    with running_service(model_repository=repo, warmup_runs=0, max_queue_delay_ms=200,
                         strict_readiness="false") as base:
        yield base


def test_failed_models_are_listed_with_why_and_the_others_serve(url):
    listed = httpx.get(f"{url}/models", timeout=10).json()
    assert "does not match the sha256" in listed["not_served"]["shapes-deit"]
    assert "no manifest.json" in listed["not_served"]["notes"] and ".cache" not in listed["not_served"]
    models = {m["name"]: m for m in listed["models"]}
    assert models["shapes-vit"]["ready"] and models["shapes-vit"]["error"] is None
    assert not models["shapes-swin"]["ready"] and models["shapes-swin"]["error"]
    r = httpx.post(f"{url}/classify", files={"file": ("a.jpg", JPEG)}, params={"model": "shapes-vit", "top_k": 6},
                   timeout=30)
    assert r.status_code == 200, r.text
    got = {p["index"]: p["score"] for p in r.json()["results"][0]["predictions"]}
    want = direct_probabilities(ROOT / "model_repository" / "shapes-vit", JPEG)
    assert max(abs(got[i] - want[i]) for i in range(6)) < 1e-5


def test_requests_for_a_failed_model_get_a_clear_error_not_a_crash(url):
    for name, status in (("shapes-swin", 503), ("shapes-deit", 404)):
        r = httpx.post(f"{url}/classify", files={"file": ("a.jpg", JPEG)}, params={"model": name}, timeout=30)
        assert r.status_code == status and r.json()["error"]["message"], r.text
    assert httpx.get(f"{url}/health/live", timeout=10).status_code == 200
    # relaxed readiness: every model loaded or failed, and at least one serving
    assert httpx.get(f"{url}/health/ready", timeout=10).status_code == 200


def test_a_batch_onnx_runtime_fails_on_fails_only_its_own_requests(url):
    def classify(*images: bytes) -> httpx.Response:
        return httpx.post(f"{url}/classify", files=[("files", (f"{i}.jpg", image)) for i, image in enumerate(images)],
                          params={"model": "shapes-vit-fragile"}, timeout=30)

    # the dark image in the batch of a bright one (one request's images are one batch, whatever the timing)
    together = classify(DARK, BRIGHT)
    assert together.status_code == 500 and together.json()["error"]["code"] == "inference_failed", together.text
    assert "Gather" in together.json()["error"]["message"]  # ONNX Runtime's own words
    after = classify(DARK)
    assert after.status_code == 200, after.text
    want = direct_probabilities(ROOT / "model_repository" / "shapes-vit", DARK)
    assert max(p["score"] for p in after.json()["results"][0]["predictions"]) == pytest.approx(want.max(), abs=1e-5)


def test_clients_that_leave_mid_upload_or_mid_queue_leave_nothing_behind(url):
    def figures() -> tuple[float, float, float]:
        """/classify requests finished (any status), images computed and images queued, for shapes-vit."""
        families = {f.name: f.samples for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
        finished = sum(s.value for s in families["vitserve_requests"]
                       if s.name == "vitserve_requests_total" and s.labels["route"] == "/classify")
        images, queued = (next((s.value for s in families[name] if s.labels.get("model") == "shapes-vit"), 0.0)
                          for name in ("vitserve_images", "vitserve_queue_depth"))  # 0 until shapes-vit has run
        return finished, images, queued

    before = process_metrics(httpx.get(f"{url}/metrics").text)["process_open_fds"]
    finished, computed, _ = figures()
    leave_mid_request(url, "shapes-vit", JPEG, images=32, clients=10)
    deadline = time.monotonic() + 60
    while (now := figures())[0] < finished + 20 or now[2] > 0:  # every one of the 20 requests over, none queued
        assert time.monotonic() < deadline, f"abandoned requests still in the service: {now}"
        time.sleep(0.2)
    assert now[1] - computed < 320 / 2  # most of the 320 images were dropped, not run for nobody
    ok = httpx.post(f"{url}/classify", files={"file": ("a.jpg", JPEG)}, params={"model": "shapes-vit"}, timeout=30)
    assert ok.status_code == 200, ok.text
    assert figures()[1] > now[1]  # the count that held the line is live (a batch may still have been running)
    assert process_metrics(httpx.get(f"{url}/metrics").text)["process_open_fds"] <= before + 2  # nothing left open


# -- the process backend's faults, survived in place -----------------------------------------------------------------

WARM_UP_S = 60  # a new inference process loads and warms up shapes-deit well within this, on a loaded 2-core host
HANG = {"inference_unready_after_s": 2, "inference_kill_after_s": 5}


def every_worker(supervisor: int, count: int, gone: int | None = None) -> set[int]:
    """The HTTP workers' pids, once all `count` are named so (ready may answer from the first while another still
    imports, under its interpreter's name), `gone` not among them."""
    deadline = time.monotonic() + WARM_UP_S
    while len(workers := set(role_pids(supervisor, "vitserve-http")) - {gone}) < count or gone in workers:
        assert time.monotonic() < deadline, f"{len(workers)} of {count} HTTP workers"
        time.sleep(0.05)
    return workers


def new_pid(supervisor: int, role: str, old: int, timeout_s: float = WARM_UP_S) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [pid for pid in role_pids(supervisor, role) if pid != old]
        if pids:
            return pids[0]
        time.sleep(0.1)
    raise AssertionError(f"no new {role} process within {timeout_s}s")


class Load:
    """Clients posting /classify in a loop, each on its own kept-alive connection, until stopped: every answer's
    time, status (or the transport error's name), error code and Retry-After. `image` is what they send next."""

    def __init__(self, url: str, clients: int = 6, timeout_s: float = 60, image: bytes = JPEG):
        self.url, self.timeout_s, self.answers, self.running, self.image = url, timeout_s, [], True, image
        self.threads = [threading.Thread(target=self._client) for _ in range(clients)]
        for thread in self.threads:
            thread.start()

    def _client(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while self.running:
                start = time.monotonic()
                try:
                    r = client.post(f"{self.url}/classify", files={"file": ("a.jpg", self.image)})
                    got = (r.status_code, r.json()["error"]["code"] if r.status_code != 200 else None,
                           r.headers.get("retry-after"))
                except httpx.TransportError as e:
                    got = (type(e).__name__, None, None)
                self.answers.append((start, time.monotonic() - start, *got))
                if got[0] != 200:
                    time.sleep(0.05)

    def since(self, moment: float) -> list[tuple]:
        return [a for a in self.answers if a[0] >= moment]

    def first(self, code: str, timeout_s: float) -> float:
        """When the first answer with this error code came."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if found := [a[0] + a[1] for a in self.answers if a[3] == code]:
                return min(found)
            time.sleep(0.05)
        raise AssertionError(f"no {code} within {timeout_s}s: {self.answers[-5:]}")

    def first_200_after(self, moment: float, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(a[2] == 200 for a in self.since(moment)):
                return min(a[0] + a[1] for a in self.since(moment) if a[2] == 200) - moment
            time.sleep(0.1)
        raise AssertionError(f"no 200 within {timeout_s}s: {self.since(moment)[-5:]}")

    def stop(self) -> None:
        self.running = False
        for thread in self.threads:
            thread.join()


@pytest.fixture(scope="module")
def small_repo(tmp_path_factory) -> Path:
    """shapes-deit alone: an inference process that starts again within seconds."""
    repo = tmp_path_factory.mktemp("one-model")
    shutil.copytree(ROOT / "model_repository" / "shapes-deit", repo / "shapes-deit")
    return repo


@pytest.fixture(scope="module")
def supervised(small_repo):
    """(URL, supervisor pid) of the process backend with small hang thresholds and a 10 s request timeout."""
    with service_and_process(backend="process", workers=2, model_repository=small_repo, request_timeout_s=10,
                             warmup_runs=1, header_timeout_s=2, **HANG) as (url, proc):
        yield url, proc.pid


def test_a_killed_inference_process_is_replaced_in_place_and_requests_get_503_meanwhile(supervised):
    url, supervisor = supervised
    (inference,) = role_pids(supervisor, "vitserve-infer")
    workers, restarts = every_worker(supervisor, 2), restart_count(url)
    load = Load(url)
    try:
        load.first_200_after(time.monotonic(), 30)
        killed = time.monotonic()
        os.kill(inference, signal.SIGKILL)
        readiness = []
        while not any(a[2] == 200 for a in load.since(killed + 0.5)) and time.monotonic() < killed + WARM_UP_S:
            readiness.append(httpx.get(f"{url}/health/ready", timeout=10).status_code)
            time.sleep(0.1)
        back = load.first_200_after(killed + 0.5, WARM_UP_S)
    finally:
        load.stop()
    during = load.since(killed - 10)
    assert all(elapsed < 10 + 5 for _, elapsed, *_ in during), max(a[1] for a in during)  # none past the timeout
    failed = [a for a in load.since(killed) if a[2] != 200]
    assert failed and all(status == 503 and retry for _, _, status, _, retry in failed), failed  # none refused
    assert {code for *_, code, _ in failed} <= {"inference_restarting", "model_loading", "not_ready"}
    assert "inference_restarting" in {code for *_, code, _ in failed}
    assert 503 in readiness and back < WARM_UP_S
    assert httpx.get(f"{url}/health/ready", timeout=10).status_code == 200
    assert role_pids(supervisor, "vitserve-infer") == [new_pid(supervisor, "vitserve-infer", inference)]
    assert restart_count(url) == restarts + 1
    assert set(role_pids(supervisor, "vitserve-http")) == workers  # the same workers: never restarted


def test_a_hung_inference_process_is_unready_then_replaced(supervised):
    url, supervisor = supervised
    (inference,) = role_pids(supervisor, "vitserve-infer")
    restarts = restart_count(url)
    os.kill(inference, signal.SIGSTOP)  # as a wedged GPU would look: nothing answers, nothing ends
    try:
        stopped = time.monotonic()
        while (r := httpx.get(f"{url}/health/ready", timeout=10)).status_code == 200:
            assert time.monotonic() < stopped + HANG["inference_unready_after_s"] + 5, "still ready"
            time.sleep(0.1)
        assert r.status_code == 503 and r.json()["error"]["code"] == "inference_unresponsive", r.text
        assert httpx.get(f"{url}/health/live", timeout=10).status_code == 200  # the HTTP side lives
        refused = httpx.post(f"{url}/classify", files={"file": ("a.jpg", JPEG)}, timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
        replaced = new_pid(supervisor, "vitserve-infer", inference, HANG["inference_kill_after_s"] + WARM_UP_S)
        assert not Path(f"/proc/{inference}").exists() or Path(f"/proc/{inference}/stat").read_text().split()[2] == "Z"
    finally:
        if Path(f"/proc/{inference}").exists():
            os.kill(inference, signal.SIGCONT)
    ready_on_every_worker(url, 2, WARM_UP_S)  # (one worker's ready says nothing of the other's, which may answer)
    ok = httpx.post(f"{url}/classify", files={"file": ("a.jpg", JPEG)}, timeout=30)
    assert ok.status_code == 200, ok.text
    assert role_pids(supervisor, "vitserve-infer") == [replaced]
    assert restart_count(url) == restarts + 1


def test_a_killed_http_worker_leaves_the_others_serving(supervised):
    url, supervisor = supervised
    workers = every_worker(supervisor, 2)
    ready_on_every_worker(url, 2, WARM_UP_S)  # each worker joins a replaced inference process on its own time
    victim = min(workers)
    os.kill(victim, signal.SIGKILL)
    answers = [httpx.post(f"{url}/classify", files={"file": ("a.jpg", JPEG)}, timeout=30) for _ in range(8)]
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers if r.status_code != 200]
    replaced = every_worker(supervisor, 2, gone=victim)
    assert workers - {victim} < replaced  # the other one served on; the victim's successor beside it


@pytest.mark.parametrize("backend", ["process", "thread"])
def test_a_slow_or_silent_request_head_is_closed_after_the_header_timeout(supervised, small_repo, backend):
    def check(url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as silent, \
                socket.create_connection((host, int(port)), timeout=30) as trickle:
            opened, head = time.monotonic(), b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40
            served = []
            for byte in head:  # a byte every 0.1 s: past the 2 s timeout before the head is whole
                try:
                    trickle.sendall(bytes([byte]))
                except OSError:  # closed by the server: what the test waits for
                    break
                served.append(httpx.get(f"{url}/health/live", timeout=5).status_code)  # others are served
                time.sleep(0.1)
            answer = trickle.recv(65536)
            assert answer.startswith(b"HTTP/1.1 408") and b"VITSERVE_HEADER_TIMEOUT_S" in answer, answer
            assert silent.recv(1) == b""  # a connection that never sent a byte is closed too, without an answer
            assert 1.5 < time.monotonic() - opened < 10 and served and set(served) == {200}

    if backend == "process":
        check(supervised[0])
    else:
        with running_service(backend="thread", model_repository=small_repo, header_timeout_s=2) as url:
            check(url)


def test_a_kept_alive_connection_idle_longer_than_uvicorns_5_s_is_still_served(small_repo):
    """An idle connection stays open VITSERVE_HEADER_TIMEOUT_S after its last answer, not uvicorn's 5 s: a client
    that reuses one idle about that long is never cut off as it sends (bench/keep_alive.py)."""
    def ask(connection: http.client.HTTPConnection) -> int:
        connection.request("GET", "/health/live")
        answer = connection.getresponse()
        answer.read()  # the whole answer, however the bytes were split, before the next request
        return answer.status

    with running_service(backend="thread", model_repository=small_repo, header_timeout_s=60) as url:
        connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
        assert ask(connection) == 200
        first = connection.sock
        time.sleep(6)  # (a lower bound: a slower host only waits longer)
        assert ask(connection) == 200 and connection.sock is first  # answered on the same connection, not a new one
        connection.close()


def test_too_many_crashes_within_the_window_stop_the_service_with_status_1(small_repo):
    with service_and_process(backend="process", workers=1, model_repository=small_repo, warmup_runs=0,
                             inference_max_crashes=2, inference_crash_window_s=300) as (url, proc):
        (first,) = role_pids(proc.pid, "vitserve-infer")
        os.kill(first, signal.SIGKILL)  # crash 1: started again
        second = new_pid(proc.pid, "vitserve-infer", first)
        wait_until_ready(url, WARM_UP_S)
        os.kill(second, signal.SIGKILL)  # crash 2 of at most 2: the service stops
        assert proc.wait(30) == 1


def restart_count(url: str) -> float:
    return metric(httpx.get(f"{url}/metrics", timeout=10).text, "vitserve_inference_restarts_total")


def ready_on_every_worker(url: str, workers: int, timeout_s: float) -> None:
    """Until each of the `workers` HTTP workers answers /health/ready 200 on a connection it holds: ready from one
    says nothing of another, which may not yet have joined a new inference process."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = connections_to_every_worker(url, workers, each=1)
        statuses = []
        for (client,) in held.values():
            connection = http.client.HTTPConnection("127.0.0.1")
            connection.sock = client  # this worker's connection, not one the kernel hands to either
            connection.request("GET", "/health/ready")
            answer = connection.getresponse()
            answer.read()
            statuses.append(answer.status)
            connection.close()
        if set(statuses) == {200}:
            return
        assert time.monotonic() < deadline, f"workers' readiness {statuses}"
        time.sleep(0.2)


def wait_until_ready(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/health/ready", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "not ready again"
        time.sleep(0.2)


# -- a device that fails every batch, a batch that never ends, restarts that back off ------------------------------

BROKEN = {"device_broken_batches": 3, "device_broken_s": 1}


@pytest.fixture(scope="module")
def fragile_repo(tmp_path_factory) -> Path:
    """shapes-vit's graph made to fail inside ONNX Runtime on bright images, alone (the default model)."""
    repo = tmp_path_factory.mktemp("fragile-alone")
    fragile(ROOT / "model_repository" / "shapes-vit", repo / "fragile")
    return repo


def test_a_device_that_fails_every_batch_has_its_inference_process_replaced_in_place(fragile_repo):
    """Every batch fails (bright images only, as a poisoned CUDA context fails every call): past 3 batches over
    1 s the inference process exits, and the supervisor starts another, as for a crash. Clients see 500s, then 503
    inference_restarting with Retry-After, never a refused connection; then, sending dark images, 200s again."""
    with service_and_process(backend="process", workers=2, model_repository=fragile_repo, warmup_runs=0,
                             request_timeout_s=10, **BROKEN) as (url, proc):
        (inference,) = role_pids(proc.pid, "vitserve-infer")
        workers, restarts = every_worker(proc.pid, 2), restart_count(url)
        load = Load(url, clients=4, image=BRIGHT)
        try:
            broke = load.first("inference_restarting", 60)
            load.image = DARK
            load.first_200_after(broke, WARM_UP_S)
        finally:
            load.stop()
        replaced = new_pid(proc.pid, "vitserve-infer", inference)
        statuses = {status for _, _, status, *_ in load.answers}
        assert statuses <= {200, 500, 503}, statuses  # no connection refused or reset
        before = [a for a in load.answers if a[0] + a[1] < broke]
        assert before and all(code == "inference_failed" for *_, code, _ in before), before[:3]
        assert all(retry for _, _, status, _, retry in load.answers if status == 503)
        assert role_pids(proc.pid, "vitserve-infer") == [replaced]
        assert restart_count(url) == restarts + 1
        assert set(role_pids(proc.pid, "vitserve-http")) == workers
        assert proc.poll() is None


def test_a_device_that_fails_every_batch_stops_the_thread_backend_with_status_75(fragile_repo):
    """The thread backend has no process to replace: it turns unready (test_device_health.py shows the 503s),
    drains and exits 75, for its orchestrator to start another."""
    with service_and_process(backend="thread", model_repository=fragile_repo, warmup_runs=0, **BROKEN) as (url, proc):
        load = Load(url, clients=4, image=BRIGHT)
        try:
            assert proc.wait(60) == 75
        finally:
            load.stop()
    codes = {code for _, _, status, code, _ in load.answers if status != 200}
    assert "inference_failed" in codes and codes <= {"inference_failed", "device_failed", None}, codes


def test_a_batch_stuck_inside_onnx_runtime_is_unready_then_replaced(tmp_path):
    """A batch that never ends while the inference process's event loop runs on (the heartbeat's loop beats, its
    progress does not): unready past VITSERVE_INFERENCE_UNREADY_AFTER_S, killed and replaced past
    VITSERVE_INFERENCE_KILL_AFTER_S; the stuck request gets 503, the next ones 200."""
    stalling(ROOT / "model_repository" / "shapes-vit", tmp_path / "stalling")
    with service_and_process(backend="process", workers=1, model_repository=tmp_path, warmup_runs=0,
                             **HANG) as (url, proc):
        (inference,) = role_pids(proc.pid, "vitserve-infer")
        stuck = []
        client = threading.Thread(target=lambda: stuck.append(
            httpx.post(f"{url}/classify", files={"file": ("a.jpg", BRIGHT)}, timeout=60)))
        client.start()
        heartbeat = Heartbeat(runtime_folder(proc.pid) / HEARTBEAT)
        deadline = time.monotonic() + 30
        while (r := httpx.get(f"{url}/health/ready", timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "still ready"
            time.sleep(0.1)
        assert r.json()["error"]["code"] == "inference_unresponsive", r.text
        loop, progress = heartbeat.values
        while loop - progress < HANG["inference_unready_after_s"]:  # the event loop beats on past the stuck batch
            assert role_pids(proc.pid, "vitserve-infer") == [inference], "replaced before its loop was seen beating"
            time.sleep(0.1)
            loop, progress = heartbeat.values
        new_pid(proc.pid, "vitserve-infer", inference, HANG["inference_kill_after_s"] + WARM_UP_S)
        client.join(60)
        assert stuck[0].status_code == 503 and stuck[0].json()["error"]["code"] == "inference_restarting"
        wait_until_ready(url, WARM_UP_S)
        ok = httpx.post(f"{url}/classify", files={"file": ("a.jpg", DARK)}, timeout=30)
        assert ok.status_code == 200, ok.text


def runtime_folder(supervisor: int) -> Path:
    """The process backend's private runtime folder, where its workers' environment points prometheus-client."""
    worker = role_pids(supervisor, "vitserve-http")[0]
    environ = dict(v.split("=", 1) for v in Path(f"/proc/{worker}/environ").read_text().split("\0") if "=" in v)
    return Path(environ["PROMETHEUS_MULTIPROC_DIR"]).parent


def test_restart_backoff_doubles_to_30s_and_crashes_older_than_the_window_are_forgotten():
    crashes = Crashes(most=3, window_s=10)
    assert crashes.crashed(100.0) and crashes.backoff_s() == 1
    assert crashes.crashed(101.0) and crashes.backoff_s() == 2
    assert not crashes.crashed(109.0)  # the third within 10 s: stop
    crashes = Crashes(most=3, window_s=10)
    for moment in (100.0, 105.0):
        assert crashes.crashed(moment)
    assert crashes.crashed(115.5) and crashes.backoff_s() == 1  # the first two are older than the window
    many = Crashes(most=100, window_s=1000)
    backoffs = [(many.crashed(float(i)), many.backoff_s())[1] for i in range(8)]
    assert backoffs == [1, 2, 4, 8, 16, 30, 30, 30]


def test_the_supervisor_waits_the_backoff_before_a_restart_and_forgets_old_crashes(small_repo):
    """Crash 1: restarted no sooner than 1 s after; crash 2 within the window: 2 s; crash 3 once both are older than
    the window: the service goes on (three within the window would have stopped it)."""
    window = 8
    with service_and_process(backend="process", workers=1, model_repository=small_repo, warmup_runs=0,
                             inference_max_crashes=3, inference_crash_window_s=window) as (url, proc):
        first = role_pids(proc.pid, "vitserve-infer")[0]
        killed = [kill(first)]
        second = new_pid(proc.pid, "vitserve-infer", first)
        starts = [started(second)]
        killed.append(kill(second))
        third = new_pid(proc.pid, "vitserve-infer", second)
        starts.append(started(third))
        waits = [start - moment for start, moment in zip(starts, killed)]
        assert waits[0] >= 1 - TICK and waits[1] >= 2 - TICK, waits
        # the supervisor counted crash 2 at least its 2 s backoff before it started the third process
        counted = starts[1] - 2
        assert counted - killed[0] < window  # (so crash 1 was within the window then: the test's premise)
        time.sleep(max(0.0, counted + window + 0.5 - uptime()))
        kill(third)
        new_pid(proc.pid, "vitserve-infer", third)
        wait_until_ready(url, WARM_UP_S)
        assert proc.poll() is None
        assert httpx.post(f"{url}/classify", files={"file": ("a.jpg", JPEG)}, timeout=30).status_code == 200


def kill(pid: int) -> float:
    """SIGKILL, and when (uptime())."""
    moment = uptime()
    os.kill(pid, signal.SIGKILL)
    return moment


TICK = 0.02  # /proc's clock ticks: 10 ms, on both readings


def uptime() -> float:
    """Seconds since boot, on the clock /proc/PID/stat's start times count in."""
    return float(Path("/proc/uptime").read_text().split()[0])


def started(pid: int) -> float:
    """When the process started, in uptime() seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")
