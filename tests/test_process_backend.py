"""The process backend: HTTP workers decode into shared memory and hand the records to one inference process.

First two workers' backends against one inference server in this process (what crosses, and what each worker
sees), then the real `python -m service --backend process` on a loopback port.
"""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, asynccontextmanager, contextmanager
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from service_process import (ROOT, direct_probabilities, every_worker_on, free_port, holders, metric, model_pixels,
                             photo_bytes, role_pids, rows_on, run_graph, running_service, service_and_process,
                             service_env, sockets_on, wait_for, workers_on, write_model)

from service.engine.backends import wire
from service.engine.backends.process import ProcessBackend
from service.engine.backends.inference_process import InferenceServer
from service.explain.cache import AttentionResult
from service.core.errors import Unavailable
from service.protocol.grpc_server import SERVICE
from service.protocol import open_inference_pb2 as pb
from service.engine.runtime import Runner
from service.core.settings import Settings

REPO = ROOT / "model_repository"
JPEG, PNG = photo_bytes("chelsea", "JPEG"), photo_bytes("astronaut", "PNG")


class Served(list):
    """The workers' backends, and (`server`) the inference server they are connected to."""
    server: InferenceServer


@asynccontextmanager
async def workers(settings: Settings, folder: Path, count: int = 2) -> AsyncIterator[Served]:
    """An inference server in this process and `count` workers' backends connected to it."""
    stop = asyncio.Event()
    inference = InferenceServer(settings, folder / "inference.sock")
    server = asyncio.create_task(inference.serve(stop))
    backends = Served(ProcessBackend(settings, folder / "inference.sock") for _ in range(count))
    backends.server = inference
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


async def until(condition) -> None:
    """Until `condition()` holds (here, where the inference server runs in this event loop too, it is a turn or
    a few of the loop away)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    pytest.fail("the condition never held")


def test_workers_share_one_inference_process_its_batches_and_its_attention_results(tmp_path, monkeypatch):
    runs = threading.Event()  # cleared: a batch waits before it runs (the server runs in this process's threads)
    runs.set()
    run = Runner.run
    monkeypatch.setattr(Runner, "run", lambda self, *a: runs.wait(10) and run(self, *a))
    # a partial batch waits up to a second for a worker that is decoding: far longer than the holds below, so
    # that no stall of a loaded host lets it go early, and a wait for it shows in a queue time at once
    settings = Settings(model_repository=REPO, queue_limit=8, max_files=8, max_batch_size=8, warmup_runs=0,
                        max_queue_delay_ms=1000)
    pixels = np.stack([model_pixels(REPO / "shapes-deit", data) for data in (JPEG, PNG)])
    want = run_graph(REPO / "shapes-deit" / "model.onnx", pixels)

    async def main():
        async with workers(settings, tmp_path) as served:
            first, second = served
            batcher = served.server.backend.batcher("shapes-deit")
            assert [e.name for e in first.entries] == [e.name for e in second.entries]
            assert all(s.ready and s.provider == "CPUExecutionProvider" for s in second.status().values())
            with first.records("shapes-deit", "image", 2) as a, second.records("shapes-deit", "image", 1) as b:
                a.records["image"], b.records["image"] = pixels, pixels[1:]
                with second.preparing("shapes-deit"):  # the second worker is decoding: a's batch waits for it
                    waits = asyncio.create_task(first.run("shapes-deit", a, 3))
                    await until(lambda: batcher.busy)  # a's images are in the inference server's queue
                    held = time.perf_counter()
                    await asyncio.sleep(0.01)  # and wait there this long at least, for b
                    held = time.perf_counter() - held
                    await second.run("shapes-deit", b, 3)
                await waits
                np.testing.assert_allclose(a.records["logits"], want[0], atol=1e-5)  # written back in shared memory
                np.testing.assert_allclose(b.records["dist_attention"][0], want[2][1], atol=1e-6)
                # one batch across workers
                assert a.records["batch_size"].tolist() == [3, 3] and b.records["batch_size"][0] == 3
                assert a.records["top_index"][0, :3].tolist() == np.argsort(-want[0][0])[:3].tolist()
                waited = a.records["queue_ms"][0]
                assert waited >= held * 1e3 - 1e-3, (waited, held)  # (float32's rounding)
            with second.records("shapes-deit", "image", 1) as alone:
                alone.records["image"] = pixels[0]
                await second.run("shapes-deit", alone, 1)
                # nobody decoding: no wait (one for the delay would show 1000 ms or more)
                assert alone.records["batch_size"][0] == 1
                assert alone.records["queue_ms"][0] < settings.max_queue_delay_ms / 2
            with (first.records("shapes-deit", "image", 8) as running,
                  first.records("shapes-deit", "image", 8) as queued,
                  second.records("shapes-deit", "image", 1) as refused):
                running.records["image"] = queued.records["image"] = refused.records["image"] = pixels[0]
                runs.clear()  # the inference thread holds the batch it runs until the refusal is seen
                await until(lambda: not batcher.busy)
                busy = asyncio.create_task(first.run("shapes-deit", running, 1))  # a full batch: it starts at once
                await until(lambda: batcher.busy)  # (its frame sent alone)
                waits = asyncio.create_task(first.run("shapes-deit", queued, 1))  # waits for it: the queue is full
                await until(lambda: batcher.depth == 8)  # its frame reached the inference process (the batch is held)
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
                gone.records["image"], gone.records["batch_size"], b.records["image"] = pixels[0], 0, pixels[1]
                await until(lambda: not batcher.busy)
                with second.preparing("shapes-deit"):  # the partial batch waits up to 1 s for the second worker
                    left = asyncio.create_task(first.run("shapes-deit", gone, 1))
                    await until(lambda: batcher.busy)  # its images are in the inference server's queue
                    left.cancel()
                    await asyncio.gather(left, return_exceptions=True)  # its worker has sent the cancel
                # b's frame travels after the cancel did, so the server has it first
                await second.run("shapes-deit", b, 1)
                assert gone.records["batch_size"].tolist() == [0] * 4 and b.records["batch_size"][0] == 1
                np.testing.assert_allclose(b.records["logits"][0], want[0][1], atol=1e-5)
            for _ in range(200):  # every slot free again, once the inference process has answered for it
                try:
                    with first.records("shapes-deit", "image", settings.queue_limit + settings.max_files):
                        break
                except Unavailable:
                    await asyncio.sleep(0.01)
            else:
                pytest.fail("the slots of a cancelled request never came back")
            assert await first.recall_attention("nope") is None
            kept = AttentionResult("shapes-deit", {"cls_attention": want[1][0]}, pixels[0], pixels[0], (96, 96))
            assert await first.store_attention("key", kept)
            back = await second.recall_attention("key")  # the other worker sees it
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
                        max_queue_delay_ms=1000)  # far longer than a stall of a loaded host (see below)
    pixels = np.stack([model_pixels(REPO / "shapes-deit", data) for data in (JPEG, PNG)])
    want = run_graph(REPO / "shapes-deit" / "model.onnx", pixels)[0]
    sent = []
    pack = wire.pack
    monkeypatch.setattr(wire, "pack", lambda message, arrays=None: sent.append(message["op"]) or pack(message, arrays))

    async def run(worker: ProcessBackend, images: np.ndarray) -> np.ndarray:
        with worker.records("shapes-deit", "image", len(images)) as lease:
            lease.records["image"] = images
            await worker.run("shapes-deit", lease, 1)
            return lease.records.copy()

    async def main():
        async with workers(settings, tmp_path) as served:
            worker, other = served
            batcher = served.server.backend.batcher("shapes-deit")
            answers = await asyncio.gather(*(run(worker, pixels[i % 2:i % 2 + 1]) for i in range(20)))
            frames = sent.count("run")
            # a frame of three that fits the queue's 24 images only in part: the third request is refused alone
            fits = await asyncio.gather(*(run(worker, pixels[[0, 1] * 5]) for _ in range(3)),
                                        return_exceptions=True)
            # a frame whose middle request is given up while its batch waits (up to the 1 s delay) for the other
            # worker's images
            await until(lambda: not batcher.busy)
            with other.preparing("shapes-deit"):
                tasks = [asyncio.create_task(run(worker, pixels[i:i + 1])) for i in (0, 1, 0)]
                await until(lambda: batcher.busy)  # their frame is in the inference server's queue
                tasks[1].cancel()
                await asyncio.gather(tasks[1], return_exceptions=True)  # its worker has sent the cancel
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


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process stopped (SIGSTOP, every thread of it) for the block, then continued."""
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while any((task / "stat").read_text().rsplit(")", 1)[1].split()[0] != "T"
                  for task in Path(f"/proc/{pid}/task").iterdir()):
            assert time.monotonic() < deadline, "the process did not stop"
            time.sleep(0.01)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def decoded(url: str) -> float:
    """Images decoded so far, by the service's HTTP workers."""
    return metric(httpx.get(f"{url}/metrics").text, "vitserve_decode_seconds_count")


def until_decoded(url: str, images: float) -> None:
    deadline = time.monotonic() + 120
    while decoded(url) < images:
        assert time.monotonic() < deadline, f"{images} images never decoded"
        time.sleep(0.02)


def finished(url: str) -> float:
    """/classify requests over (whatever their status, or none where the client left)."""
    return sum(s.value for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
               for s in family.samples if s.name == "vitserve_requests_total" and s.labels["route"] == "/classify")


def uploaded(url: str, model: str, image: bytes, images: int) -> socket.socket:
    """A connection that has sent a whole /classify upload of `images` copies of `image` and waits for its answer."""
    host, port = url.removeprefix("http://").split(":")
    body = b"".join(b"--b\r\nContent-Disposition: form-data; name=\"files\"; filename=\"a.jpg\"\r\n\r\n" + image
                    + b"\r\n" for _ in range(images)) + b"--b--\r\n"
    client = socket.create_connection((host, int(port)), timeout=60)
    client.sendall(f"POST /classify?model={model} HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
                   f"boundary=b\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    return client


def test_across_the_process_boundary_a_workers_requests_share_a_frame_and_one_given_up_is_never_computed():
    """The real service with one HTTP worker, real clients. The inference process is stopped (SIGSTOP) while
    requests come, so that what waits for it waits however fast the host. A worker's first request for a model
    goes at once, alone, as a frame; those that come while that frame waits stay in the worker's outbox and follow
    as one frame, which runs as one batch. A request whose client leaves while it waits, in the outbox or in the
    inference process's queue, never reaches a batch.

    When the worker holds a request in its outbox is told by its one decode thread: a request for another model
    (which its own outbox sends on) decoded after the others means that thread has handed each of them to the
    worker's event loop, where it joins the outbox before anything the inference process says can be read."""
    deit, vit = "shapes-deit", "shapes-vit"
    expected = {data: direct_probabilities(REPO / deit, data) for data in (JPEG, PNG)}

    def post(model: str, data: bytes) -> httpx.Response:
        return httpx.post(f"{url}/classify", files={"file": ("a", data)}, params={"model": model, "top_k": 6},
                          timeout=600)

    def probabilities(answer: httpx.Response) -> tuple[list[float], int]:
        assert answer.status_code == 200, answer.text
        (result,) = answer.json()["results"]
        got = {p["index"]: p["score"] for p in result["predictions"]}
        return [got[i] for i in range(6)], result["batch_size"]

    with (service_and_process(backend="process", workers=1, decode_threads=1, max_batch_size=8,
                              inference_unready_after_s=600, inference_kill_after_s=1200, request_timeout_s=600)
          as (url, supervisor), ThreadPoolExecutor(32) as pool):  # a thread for each request under way
        (inference,) = role_pids(supervisor.pid, "vitserve-infer")
        others = []  # shapes-vit's requests, each sent to learn that the ones before it are in the outbox

        def handed_over(images: float) -> None:
            """Once `images` are decoded: every request decoded so far is in the worker's outbox or sent."""
            until_decoded(url, images)
            others.append(pool.submit(post, vit, JPEG))
            until_decoded(url, images + 1)

        # several requests of one worker: one frame, one batch
        before, start = httpx.get(f"{url}/metrics").text, decoded(url)
        with stopped(inference):
            first = pool.submit(post, deit, JPEG)
            handed_over(start + 1)  # its frame sent, alone
            photos = [JPEG, PNG] * 3
            rest = [pool.submit(post, deit, data) for data in photos]
            handed_over(start + 8)  # all six in the outbox, behind the first one's frame
        alone, size = probabilities(first.result())
        assert size == 1
        np.testing.assert_allclose(alone, expected[JPEG], atol=1e-5)
        for data, answer in zip(photos, rest):
            got, size = probabilities(answer.result())
            assert size == 6  # one batch of all six
            np.testing.assert_allclose(got, expected[data], atol=1e-5)  # each its own image's answer
        after = httpx.get(f"{url}/metrics").text
        batches = lambda size: (metric(after, "vitserve_batches_total", model=deit, batch_size=size)  # noqa: E731
                                - metric(before, "vitserve_batches_total", model=deit, batch_size=size))
        assert batches("1") == 1 and batches("6") == 1
        assert metric(after, "vitserve_images_total", model=deit) - metric(before, "vitserve_images_total",
                                                                           model=deit) == 7

        # requests given up: one in the inference process's queue, one in the outbox; and one that stays
        before, start = after, decoded(url)
        with stopped(inference):
            queued = uploaded(url, deit, JPEG, 3)
            handed_over(start + 3)  # its frame sent
            waiting = uploaded(url, deit, PNG, 2)
            handed_over(start + 6)  # in the outbox, behind the frame
            over = finished(url)
            queued.close()  # their clients leave: the worker sends a cancel after the first one's frame, and
            waiting.close()  # takes the second out of its outbox
            deadline = time.monotonic() + 60
            while finished(url) < over + 2:
                assert time.monotonic() < deadline, "the worker never saw its clients go"
                time.sleep(0.02)
            stays = pool.submit(post, deit, PNG)
            handed_over(start + 8)  # in the outbox too
        got, size = probabilities(stays.result())
        assert size == 1  # none of the five images given up ran with it
        np.testing.assert_allclose(got, expected[PNG], atol=1e-5)
        after = httpx.get(f"{url}/metrics").text
        # the five images given up never reached a batch: one image computed, in one batch
        assert metric(after, "vitserve_images_total", model=deit) - metric(before, "vitserve_images_total",
                                                                           model=deit) == 1
        ran = [s for f in text_string_to_metric_families(after) for s in f.samples
               if s.name == "vitserve_batches_total" and s.labels["model"] == deit]
        assert sum(s.value for s in ran) - sum(
            s.value for f in text_string_to_metric_families(before) for s in f.samples
            if s.name == "vitserve_batches_total" and s.labels["model"] == deit) == 1
        assert all(answer.result().status_code == 200 for answer in others)


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
                  architecture="deit_micro_distilled_patch8_96", task="classification", precision="fp32",
                  provider="CPUExecutionProvider") == 1
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
def test_ready_only_after_warm_up_and_sigterm_finishes_every_accepted_request(backend, tmp_path):
    grpc_port = free_port()
    write_model(tmp_path / "shapes-deit", REPO / "shapes-deit", "shapes-deit")  # its long warm-up alone is enough
    with service_and_process(model_repository=tmp_path, wait_ready=False, backend=backend, workers=2,
                             warmup_runs=150, max_batch_size=4, grpc_port=grpc_port) as (base, proc):
        early = httpx.get(f"{base}/health/ready")
        assert early.status_code == 503 and early.json()["error"]["code"] == "not_ready"
        wait_for(base, "/health/ready", proc)
        port = int(base.rsplit(":", 1)[1])

        async def requests_then_sigterm():
            async with httpx.AsyncClient(timeout=60) as client, grpc.aio.insecure_channel(
                    f"127.0.0.1:{grpc_port}") as channel:
                before = (await client.get(f"{base}/metrics")).text
                computed = lambda text: metric(text, "vitserve_images_total", model="shapes-deit")  # noqa: E731
                files = [("files", (f"{i}.jpg", JPEG)) for i in range(16)]
                pending = [asyncio.create_task(client.post(f"{base}/classify", files=files,
                                                           params={"model": "shapes-deit"})) for _ in range(8)]
                model_infer = channel.unary_unary(f"/{SERVICE}/ModelInfer", pb.ModelInferRequest.SerializeToString,
                                                  pb.ModelInferResponse.FromString)
                x = np.zeros((16, 96, 96, 3), np.uint8)
                calls = [model_infer(pb.ModelInferRequest(model_name="shapes-deit", raw_input_contents=[x.tobytes()],
                                                          inputs=[pb.ModelInferRequest.InferInputTensor(
                                                              name="images", datatype="UINT8", shape=x.shape)]))
                         for _ in range(4)]
                # one request certainly under way at SIGTERM, however fast the host: the server has read its head
                # and waits for its body (its "100 Continue" says so), which comes only after the signal
                body = (b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jpg\"\r\n\r\n" + JPEG
                        + b"\r\n--b--\r\n")
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"POST /classify?model=shapes-deit HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                             b"Content-Type: multipart/form-data; boundary=b\r\n"
                             + f"Content-Length: {len(body)}\r\n\r\n".encode())
                assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60) == b"HTTP/1.1 100 Continue\r\n\r\n"
                # every other request accepted too: all 192 images of them queued or computed (one not yet queued
                # leaves 16 out, more than the batches that run at once hold: four or eight a model)
                deadline = time.monotonic() + 60
                while True:
                    now = (await client.get(f"{base}/metrics")).text
                    depth = metric(now, "vitserve_queue_depth", model="shapes-deit")
                    if computed(now) - computed(before) + depth > 176:
                        break
                    assert time.monotonic() < deadline, "the requests were not all accepted within 60 s"
                    await asyncio.sleep(0.02)
                proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 30
                while True:  # new connections refused soon, while an accepted request is still being sent
                    try:
                        await asyncio.to_thread(httpx.get, f"{base}/health/ready", timeout=5)
                    except httpx.ConnectError:
                        break
                    except (httpx.ReadError, httpx.RemoteProtocolError):  # connected as the server stopped listening:
                        pass  # closed unanswered (reset), as uvicorn closes what it has not begun to serve
                    assert time.monotonic() < deadline, "new connections still accepted 30 s after SIGTERM"
                    await asyncio.sleep(0.02)
                writer.write(body)  # the accepted one's body, after its server began to stop
                held = await asyncio.wait_for(reader.read(), 60)  # its answer, then the server closes it
                writer.close()
                return await asyncio.gather(*pending), await asyncio.gather(*calls), held, time.monotonic()

        responses, answers, held, answered = asyncio.run(requests_then_sigterm())
        assert held.startswith(b"HTTP/1.1 200 ") and len(json.loads(held.partition(b"\r\n\r\n")[2])["results"]) == 1
        assert [r.status_code for r in responses] == [200] * 8
        assert all(len(r.json()["results"]) == 16 for r in responses)
        assert [a.outputs[0].shape for a in answers] == [[16, 6]] * 4  # the gRPC calls under way finish too
        # a clean exit, soon after the last answer: well within the 35 s uvicorn would wait for a request held open
        assert proc.wait(30) == 0 and time.monotonic() - answered < 15
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{base}/health/live")


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


def backlogs(port: int) -> dict[str, int]:
    """The connections waiting to be accepted on each of the port's listening sockets, by its inode."""
    return {row[9]: int(row[4].split(":")[1], 16) for row in rows_on(port, "0A")}


@pytest.mark.skipif(sys.platform != "linux", reason="SO_REUSEPORT spreads connections on Linux alone")
def test_connections_spread_over_the_workers_and_a_killed_workers_share_waits_for_its_successor():
    """Which socket the kernel gives a connection is its hash's affair, so this counts what each socket got: those
    that came to a stopped worker's socket waited there for it, and no other worker took them."""
    with running_service(backend="process", workers=4) as base, ExitStack() as stack:
        port = int(base.rsplit(":", 1)[1])
        before = every_worker_on(port, 4)
        own = {pid: inodes & sockets_on(port, "0A") for pid, inodes in before.items()}
        # a listening socket of its own for each worker, on the one port: four in all
        assert len(own) == 4 and all(len(s) == 1 for s in own.values()) and len(set().union(*own.values())) == 4
        own = {pid: inode for pid, (inode,) in own.items()}
        awake, *busy = sorted(before)
        # a burst while all workers but one are busy (stopped): on one shared socket the one awake would accept
        # them all; here each worker's own socket holds what came to it until the worker is free
        for pid in busy:
            os.kill(pid, signal.SIGSTOP)
        try:
            clients = connect(port, stack, 256)  # each connected: accepted, or waiting in its socket's queue
            deadline = time.monotonic() + 60
            while backlogs(port)[own[awake]]:  # until the one awake has accepted all that came to its socket
                assert time.monotonic() < deadline, "the worker awake left connections in its queue"
                time.sleep(0.05)
            waiting = {pid: backlogs(port)[own[pid]] for pid in busy}
        finally:  # never left stopped, holding the port
            for pid in busy:
                os.kill(pid, signal.SIGCONT)
        counts = Counter(holders(port, clients))
        assert {pid: counts[pid] for pid in busy} == waiting  # each stopped worker took what waited for it, no more
        assert counts[awake] == len(clients) - sum(waiting.values()), (counts, waiting)  # and the awake one its own
        assert status_lines(clients) == {b"HTTP/1.1 200 OK"}

        victim = min(before)
        share = own[victim]  # its listening socket, which the supervisor keeps open
        os.kill(victim, signal.SIGKILL)
        # new connections, until the kernel has sent some to the victim's socket: they wait there until its
        # successor accepts them, not refused or reset
        clients = []
        while not set(accepted := holders(port, clients)) - set(before):
            assert len(clients) < 1024, Counter(accepted)
            clients += connect(port, stack, 64)
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
