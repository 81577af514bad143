"""The process backend: HTTP workers decode into shared memory and hand the records to one inference process.

First two workers' backends against one inference server in this process (what crosses, and what each worker
sees), then the real `python -m service --backend process` on a loopback port.
"""
import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from service_process import (ROOT, direct_probabilities, free_port, metric, model_pixels, photo_bytes, run_graph,
                             running_service, service_env, wait_for)

from service.backends import wire
from service.backends.process import ProcessBackend
from service.backends.server import InferenceServer
from service.cache import AttentionRecord
from service.errors import Unavailable
from service.grpc_server import SERVICE
from service.protocol import open_inference_pb2 as pb
from service.runtime import Runner
from service.settings import Settings

REPO = ROOT / "model_repository"
JPEG, PNG = photo_bytes("chelsea", "JPEG"), photo_bytes("astronaut", "PNG")


@asynccontextmanager
async def workers(settings: Settings, folder: Path, count: int = 2) -> AsyncIterator[list[ProcessBackend]]:
    """An inference server in this process and `count` workers' backends connected to it."""
    stop = asyncio.Event()
    server = asyncio.create_task(InferenceServer(settings, folder / "inference.sock").serve(stop))
    backends = [ProcessBackend(settings, folder / "inference.sock") for _ in range(count)]
    try:
        await asyncio.gather(*(b.start() for b in backends))
        await asyncio.gather(*(b.loaded() for b in backends))
        yield backends
    finally:
        for backend in backends:
            await backend.close()
        stop.set()
        await server
    assert not list(folder.glob("arena-*")) and not list(folder.glob("board-*"))  # the workers removed theirs


def test_workers_share_one_inference_process_its_batches_and_its_attention_results(tmp_path, monkeypatch):
    runs = threading.Event()  # cleared: a batch waits before it runs (the server runs in this process's threads)
    runs.set()
    run = Runner.run
    monkeypatch.setattr(Runner, "run", lambda self, *a: runs.wait(10) and run(self, *a))
    settings = Settings(model_repository=REPO, queue_limit=8, max_files=8, max_batch_size=8, warmup_runs=0,
                        max_queue_delay_ms=50)
    pixels = np.stack([model_pixels(REPO / "shapes-deit", data) for data in (JPEG, PNG)])
    want = run_graph(REPO / "shapes-deit" / "model.onnx", pixels)

    async def main():
        async with workers(settings, tmp_path) as (first, second):
            assert [e.name for e in first.entries] == [e.name for e in second.entries]
            assert all(s.ready and s.provider == "CPUExecutionProvider" for s in second.status().values())
            with first.records("shapes-deit", "image", 2) as a, second.records("shapes-deit", "image", 1) as b:
                a["image"], b["image"] = pixels, pixels[1:]
                with second.preparing("shapes-deit"):  # the second worker is decoding: a's batch waits for it
                    await asyncio.sleep(0.005)
                    waits = asyncio.create_task(first.run("shapes-deit", a, 3))
                    await asyncio.sleep(0.01)
                    await second.run("shapes-deit", b, 3)
                await waits
                np.testing.assert_allclose(a["logits"], want[0], atol=1e-5)  # written back in shared memory
                np.testing.assert_allclose(b["dist_attention"][0], want[2][1], atol=1e-6)
                assert a["batch_size"].tolist() == [3, 3] and b["batch_size"][0] == 3  # one batch across workers
                assert a["queue_ms"][0] >= 10 and a["top_index"][0, :3].tolist() == np.argsort(-want[0][0])[:3].tolist()
            with second.records("shapes-deit", "image", 1) as alone:
                alone["image"] = pixels[0]
                await second.run("shapes-deit", alone, 1)
                assert alone["batch_size"][0] == 1 and alone["queue_ms"][0] < 25  # nobody decoding: no wait
            with (first.records("shapes-deit", "image", 8) as running,
                  first.records("shapes-deit", "image", 8) as queued,
                  second.records("shapes-deit", "image", 1) as refused):
                running["image"] = queued["image"] = refused["image"] = pixels[0]
                runs.clear()  # the inference thread holds the batch it runs until the refusal is seen
                busy = asyncio.create_task(first.run("shapes-deit", running, 1))  # a full batch: it starts at once
                await asyncio.sleep(0.005)
                waits = asyncio.create_task(first.run("shapes-deit", queued, 1))  # waits for it: the queue is full
                await asyncio.sleep(0.05)  # its frame reaches the inference process (the batch is held meanwhile)
                with pytest.raises(Unavailable, match="would pass its limit of 8") as e:
                    await second.run("shapes-deit", refused, 1)
                runs.set()
                assert e.value.code == "overloaded" and e.value.retry_after_s == 1
                await asyncio.gather(busy, waits)
            with pytest.raises(Unavailable, match="no room"):  # a worker's own slots are bounded too
                with first.records("shapes-deit", "image", settings.queue_limit + settings.max_files + 1):
                    pass
            # a caller that gives up (its client left) while its images wait in a partial batch: the inference
            # process leaves them out, writes nothing into their records, and the slots come back with its reply
            with first.records("shapes-deit", "image", 4) as gone, second.records("shapes-deit", "image", 1) as b:
                gone["image"], gone["batch_size"], b["image"] = pixels[0], 0, pixels[1]
                with second.preparing("shapes-deit"):  # the partial batch waits up to 50 ms for the second worker
                    left = asyncio.create_task(first.run("shapes-deit", gone, 1))
                    await asyncio.sleep(0.01)
                    left.cancel()
                    await asyncio.sleep(0.1)
                await second.run("shapes-deit", b, 1)
                assert gone["batch_size"].tolist() == [0] * 4 and b["batch_size"][0] == 1
                np.testing.assert_allclose(b["logits"][0], want[0][1], atol=1e-5)
            for _ in range(200):  # every slot free again, once the inference process has answered for it
                try:
                    with first.records("shapes-deit", "image", settings.queue_limit + settings.max_files):
                        break
                except Unavailable:
                    await asyncio.sleep(0.01)
            else:
                pytest.fail("the slots of a cancelled request never came back")
            assert await first.recall("nope") is None
            kept = AttentionRecord("shapes-deit", {"cls_attention": want[1][0]}, pixels[0], pixels[0], (96, 96))
            assert await first.keep("key", kept)
            back = await second.recall("key")  # the other worker sees it
            assert back.model == "shapes-deit" and back.size == (96, 96)
            np.testing.assert_array_equal(back.attention["cls_attention"], want[1][0])
            layers = await second.explain("shapes-deit", pixels[0])
            explain = run_graph(REPO / "shapes-deit" / "explain.onnx", pixels[:1])
            assert len(layers) == len(explain) and np.allclose(layers[-1], explain[-1][0], atol=1e-5)

    asyncio.run(main())


def test_a_workers_requests_travel_as_one_frame_and_each_gets_its_own_rows(tmp_path, monkeypatch):
    """Requests a worker holds at once reach the inference process as one message, whatever their number, and run
    in one batch; each gets its own images' results. Requests of a frame that the queue has no room for are refused
    alone, and a request given up while its frame waits leaves it."""
    settings = Settings(model_repository=REPO, queue_limit=24, max_files=8, max_batch_size=32, warmup_runs=0,
                        max_queue_delay_ms=100)
    pixels = np.stack([model_pixels(REPO / "shapes-deit", data) for data in (JPEG, PNG)])
    want = run_graph(REPO / "shapes-deit" / "model.onnx", pixels)[0]
    sent = []
    pack = wire.pack
    monkeypatch.setattr(wire, "pack", lambda message, arrays=None: sent.append(message["op"]) or pack(message, arrays))

    async def run(worker: ProcessBackend, images: np.ndarray) -> np.ndarray:
        with worker.records("shapes-deit", "image", len(images)) as records:
            records["image"] = images
            await worker.run("shapes-deit", records, 1)
            return records.copy()

    async def main():
        async with workers(settings, tmp_path) as (worker, other):
            answers = await asyncio.gather(*(run(worker, pixels[i % 2:i % 2 + 1]) for i in range(20)))
            frames = sent.count("run")
            # a frame of three that fits the queue's 24 images only in part: the third request is refused alone
            fits = await asyncio.gather(*(run(worker, pixels[[0, 1] * 5]) for _ in range(3)),
                                        return_exceptions=True)
            # a frame whose middle request is given up while its batch waits for the other worker's images
            with other.preparing("shapes-deit"):
                tasks = [asyncio.create_task(run(worker, pixels[i:i + 1])) for i in (0, 1, 0)]
                await asyncio.sleep(0.02)
                tasks[1].cancel()
                await asyncio.sleep(0.01)
            kept = await asyncio.gather(tasks[0], tasks[2])
            return answers, frames, fits, kept

    answers, frames, fits, kept = asyncio.run(main())
    assert frames == 1  # twenty requests, one message
    for i, records in enumerate(answers):
        np.testing.assert_allclose(records["logits"][0], want[i % 2], atol=1e-5)
        assert records["batch_size"][0] == 20
    assert all(isinstance(f, np.ndarray) for f in fits[:2]) and isinstance(fits[2], Unavailable)
    assert fits[2].code == "overloaded" and "limit of 24" in fits[2].message
    np.testing.assert_allclose(fits[1]["logits"], want[[0, 1] * 5], atol=1e-5)
    assert [records["batch_size"][0] for records in kept] == [2, 2]  # the cancelled one left the batch
    np.testing.assert_allclose(kept[1]["logits"][0], want[0], atol=1e-5)


@pytest.fixture(scope="module")
def url():
    with running_service(backend="process", workers=2, queue_limit=8, max_queue_delay_ms=2) as base:
        yield base


def classify(url: str, *uploads: tuple[str, bytes], **params) -> httpx.Response:
    files = [("files" if len(uploads) > 1 else "file", upload) for upload in uploads]
    return httpx.post(f"{url}/classify", files=files, params=params, timeout=30)


def test_answers_equal_a_direct_session_and_every_worker_finds_the_attention_maps(url):
    r = classify(url, ("a.jpg", JPEG), ("b.png", PNG), model="shapes-swin", top_k=6, attention="true")
    assert r.status_code == 200, r.text
    for result, data in zip(r.json()["results"], (JPEG, PNG)):
        got = {p["index"]: p["score"] for p in result["predictions"]}
        np.testing.assert_allclose([got[i] for i in range(6)], direct_probabilities(REPO / "shapes-swin", data),
                                   atol=1e-5)
    keys = [result["id"] for result in r.json()["results"]]
    for i in range(12):  # a new connection each time, spread over both workers
        got = httpx.get(f"{url}/attention-map", params={"id": keys[i % 2], "format": "json"})
        assert got.status_code == 200 and got.json()["grid_size"] == [6, 6]
    models = {m["name"]: m for m in httpx.get(f"{url}/models").json()["models"]}
    assert models["shapes-swin"]["ready"] and models["shapes-vit-int8"]["precision"] == "int8"


def test_metrics_add_up_over_all_processes(url):  # 8 requests: never more than the queue limit
    before = httpx.get(f"{url}/metrics").text

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(f"{url}/classify", files={"file": ("a.jpg", JPEG)},
                                                      params={"model": "shapes-deit"}) for _ in range(8)))

    assert all(r.status_code == 200 for r in asyncio.run(burst()))
    after = httpx.get(f"{url}/metrics").text
    delta = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)  # noqa: E731
    model = {"model": "shapes-deit"}
    assert delta("vitserve_images_total", **model) == 8  # counted in the inference process
    assert delta("vitserve_requests_total", route="/classify", method="POST", status="200") == 8  # in the workers
    assert delta("vitserve_decode_seconds_count") == 8 and delta("vitserve_queue_seconds_count", **model) == 8
    assert metric(after, "vitserve_model_ready", model="shapes-deit") == 1
    assert metric(after, "vitserve_model_info", model="shapes-deit", version="1",
                  architecture="deit_micro_distilled_patch8_96", task="classification", precision="fp32", provider="CPUExecutionProvider") == 1
    # the supervisor, the inference process and both workers: more memory than one process holds
    assert metric(after, "process_resident_memory_bytes") > 300 * 2**20
    assert metric(after, "process_cpu_seconds_total") > metric(before, "process_cpu_seconds_total")


def test_more_images_than_the_queue_holds_get_413_and_bad_input_a_clear_4xx(url):
    never = classify(url, *[(f"{i}.jpg", JPEG) for i in range(9)])  # a full queue's 503: the first test
    assert never.status_code == 413 and never.json()["error"]["code"] == "too_many_images"
    v2 = httpx.post(f"{url}/v2/models/shapes-deit/infer", timeout=30, json={"inputs": [
        {"name": "images", "datatype": "UINT8", "shape": [9, 96, 96, 3], "data": [0] * (9 * 96 * 96 * 3)}]})
    assert v2.status_code == 413 and "queue holds 8" in v2.json()["error"]
    bad = classify(url, ("notes.txt", b"just some text"))
    assert bad.status_code == 415 and bad.json()["error"]["code"] == "unsupported_media_type"
    assert classify(url, ("a.jpg", JPEG)).status_code == 200


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_ready_only_after_warm_up_and_sigterm_finishes_every_accepted_request(backend):
    port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "service", "--port", str(port), "--log-level", "warning"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=service_env({"backend": backend, "workers": 2, "warmup_runs": 40,
                                             "max_batch_size": 4, "grpc_port": grpc_port}))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(base, "/health/live", proc)
        early = httpx.get(f"{base}/health/ready")
        assert early.status_code == 503 and early.json()["error"]["code"] == "not_ready"
        wait_for(base, "/health/ready", proc)

        async def requests_then_sigterm():
            async with httpx.AsyncClient(timeout=60) as client, grpc.aio.insecure_channel(
                    f"127.0.0.1:{grpc_port}") as channel:
                files = [("files", (f"{i}.jpg", JPEG)) for i in range(16)]
                pending = [asyncio.create_task(client.post(f"{base}/classify", files=files)) for _ in range(8)]
                model_infer = channel.unary_unary(f"/{SERVICE}/ModelInfer", pb.ModelInferRequest.SerializeToString,
                                                  pb.ModelInferResponse.FromString)
                x = np.zeros((16, 96, 96, 3), np.uint8)
                calls = [model_infer(pb.ModelInferRequest(model_name="shapes-deit", raw_input_contents=[x.tobytes()],
                                                          inputs=[pb.ModelInferRequest.InferInputTensor(
                                                              name="images", datatype="UINT8", shape=x.shape)]))
                         for _ in range(4)]
                await asyncio.sleep(0.5)  # accepted and queued: 192 images, batches of 4
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                with pytest.raises(httpx.ConnectError):  # refused at once, while the accepted ones finish
                    httpx.get(f"{base}/health/ready", timeout=5)
                return await asyncio.gather(*pending), await asyncio.gather(*calls), time.monotonic()

        responses, answers, answered = asyncio.run(requests_then_sigterm())
        assert [r.status_code for r in responses] == [200] * 8
        assert all(len(r.json()["results"]) == 16 for r in responses)
        assert [a.outputs[0].shape for a in answers] == [[16, 6]] * 4  # the gRPC calls under way finish too
        assert proc.wait(30) == 0 and time.monotonic() - answered < 15  # a clean exit, soon after the last answer
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{base}/health/live")
    finally:
        proc.kill()


def rows_on(port: int, state: str) -> list[list[str]]:
    """The rows of /proc/net/tcp of this port's TCP sockets in a state ("0A" listening, "01" established)."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return [row for row in rows if int(row[1].rsplit(":", 1)[1], 16) == port and row[3] == state]


def sockets_on(port: int, state: str) -> set[str]:
    """The inodes of this port's TCP sockets in a state."""
    return {row[9] for row in rows_on(port, state)}


def server_ends(port: int) -> dict[int, str]:
    """The inode of the server's end of each connection to the port ("0" until accepted), by the client's port."""
    return {int(row[2].rsplit(":", 1)[1], 16): row[9] for row in rows_on(port, "01")}


def workers_on(port: int) -> dict[int, set[str]]:
    """Each HTTP worker listening on the port, with the inodes of all its sockets."""
    listening, workers = sockets_on(port, "0A"), {}
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or (proc / "comm").read_text().strip() != "vitserve-http":
                continue
            links = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:  # gone meanwhile
            continue
        inodes = {link[len("socket:["):-1] for link in links if link.startswith("socket:[")}
        if inodes & listening:
            workers[int(proc.name)] = inodes
    return workers


def holders(port: int, clients: list[socket.socket], timeout: float = 120) -> list[int]:
    """The HTTP worker that accepted each client's connection, once every one is accepted."""
    deadline = time.monotonic() + timeout
    while True:
        ends, held = server_ends(port), {inode: pid for pid, inodes in workers_on(port).items() for inode in inodes}
        found = [held.get(ends.get(client.getsockname()[1], "0")) for client in clients]
        if None not in found:
            return found
        assert time.monotonic() < deadline, f"{found.count(None)} of {len(clients)} connections never accepted"
        time.sleep(0.1)


# a request whose head lacks its last line: the worker that accepted its connection holds it until the line comes
# (uvicorn times no request being read, unlike the 5 s it keeps a connection alive after an answer), then answers
# and closes it
BEGUN, END_OF_HEAD = b"GET /health/live HTTP/1.1\r\nHost: test\r\nConnection: close\r\n", b"\r\n"


def connect(port: int, stack: ExitStack, count: int) -> list[socket.socket]:
    """`count` connections to the port, each with a request BEGUN."""
    clients = [stack.enter_context(socket.create_connection(("127.0.0.1", port), timeout=60)) for _ in range(count)]
    for client in clients:
        client.sendall(BEGUN)
    return clients


def status_lines(clients: list[socket.socket]) -> set[bytes]:
    """Each request ended: the status lines of the answers."""
    for client in clients:
        client.sendall(END_OF_HEAD)
    return {client.recv(4096).partition(b"\r\n")[0] for client in clients}


@pytest.mark.skipif(sys.platform != "linux", reason="SO_REUSEPORT spreads connections on Linux alone")
def test_connections_spread_over_the_workers_and_a_killed_workers_share_waits_for_its_successor():
    with running_service(backend="process", workers=4) as base, ExitStack() as stack:
        port = int(base.rsplit(":", 1)[1])
        before = workers_on(port)
        busy = sorted(before)[1:]
        # a burst while all workers but one are busy (stopped): on one shared socket the one awake accepted what
        # came meanwhile (30 to 126 a worker); each worker's own socket holds its share until it is free
        for pid in busy:
            os.kill(pid, signal.SIGSTOP)
        try:
            clients = connect(port, stack, 256)
        finally:  # never left stopped, holding the port
            for pid in busy:
                os.kill(pid, signal.SIGCONT)
        counts = sorted(Counter(holders(port, clients)).values())
        assert len(counts) == 4
        assert counts[0] >= 32 and counts[-1] <= 96, counts  # hashed over four sockets: 64 each, give or take 7
        assert status_lines(clients) == {b"HTTP/1.1 200 OK"}

        victim = min(before)
        (share,) = before[victim] & sockets_on(port, "0A")  # its listening socket, which the supervisor keeps open
        os.kill(victim, signal.SIGKILL)
        # new connections, a quarter of them to the victim's socket: queued there until its successor accepts them,
        # not refused or reset
        clients = connect(port, stack, 64)
        accepted = holders(port, clients)
        successors = workers_on(port)
        (successor,) = set(successors) - set(before)
        assert victim not in successors and len(successors) == 4 and share in successors[successor]
        assert set(accepted) - set(before) == {successor}, Counter(accepted)  # its share, the others' theirs
        assert status_lines(clients) == {b"HTTP/1.1 200 OK"}

        # a second service on the port is refused, though its sockets could have joined the first's
        second = subprocess.run([sys.executable, "-m", "service", "--port", str(port)], cwd=ROOT, check=False,
                                capture_output=True, text=True, timeout=60,
                                env=service_env({"backend": "process", "workers": 2}))
        assert second.returncode != 0 and "Address already in use" in second.stderr
