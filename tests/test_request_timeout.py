"""VITSERVE_REQUEST_TIMEOUT_S on a real server, on both backends (docs/serving.md: "a request that waits longer than
request_timeout_s gets 503 too and leaves the queue"): the 503, with Retry-After and the error code, and the
request's images never reaching a batch, as /metrics counts the images computed.

The queue is made long, whatever the host's speed, by a batch that takes seconds: a `stalling` copy of a model
(fault_graphs.py) whose graph turns a Loop a number of times, sized here for this host (`turns_for`), where the batch
holds an image whose top-left input pixel is bright, and not at all otherwise (darker images get the source model's
answers as fast). With max_batch_size 1, a request of two bright images has one in a batch and one in the queue: the
queue's depth on /metrics then says that its batch runs, and what comes next waits behind it. (tests/test_app.py has the
same 503 over a backend that never answers, in this process.)"""
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
from fault_graphs import stalling, turns_for
from service_process import ROOT, direct_probabilities, free_port, metric, model_pixels, photo_bytes, running_service
from tritonclient.utils import InferenceServerException

from service.loadtest import v2_body

REPO = ROOT / "model_repository"
MODEL = "slow-vit"
MID = "mid-vit"  # the same stall at a tenth of the turns: a bright batch of about BATCH_S / 10
TIMEOUT_S = 1.0
BATCH_S = 4.0  # the slow batch, here: the requests behind it time out (at 1 s) well before it ends
RETRY_AFTER_S = 2
BLOCKER = model_pixels(REPO / "shapes-vit", photo_bytes("astronaut", "JPEG"))  # its top-left pixel: 168
WAITING = ["coffee", "rocket", "chelsea", "hubble_deep_field"]  # top-left pixels 40, 19, 121, 56: fast


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("repository")
    turns = turns_for(BATCH_S, REPO / "shapes-vit", repo.parent)
    stalling(REPO / "shapes-vit", repo / MODEL, turns)
    stalling(REPO / "shapes-vit", repo / MID, turns // 10)
    return repo


def figures(url: str, model: str = MODEL) -> tuple[float, float]:
    """The model's images computed (counted as each batch ends) and images queued (not in a batch)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return metric(text, "vitserve_images_total", model=model), metric(text, "vitserve_queue_depth", model=model)


def until(condition, what: str, timeout_s: float = 120):
    """Polls `condition` until it gives something true, and returns that (a liveness bound, not a measurement)."""
    deadline = time.monotonic() + timeout_s
    while not (found := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        time.sleep(0.02)
    return found


def jpegs(names: list[str]) -> list[tuple[str, tuple[str, bytes]]]:
    return [("files", (f"{name}.jpg", photo_bytes(name, "JPEG"))) for name in names]


@pytest.mark.parametrize("backend,workers", [("thread", 0), ("process", 2)])
def test_a_request_past_the_timeout_gets_503_and_its_images_never_reach_a_batch(repository, backend, workers):
    """A blocker of two bright images on /v2 infer (never run in a decode thread: it goes through the queue), one
    of them in a batch of BATCH_S; then three /classify requests of four photos each, queued behind it. All four
    wait past TIMEOUT_S: 503, Retry-After, `overloaded` (under /v2 the protocol's plain message). Computed: the
    one image of the slow batch, and afterwards a request's own, nothing else."""
    settings = {"backend": backend, "model_repository": repository, "max_batch_size": 1,
                "request_timeout_s": TIMEOUT_S, "retry_after_s": RETRY_AFTER_S,
                # one core for the slow batch, and no spinning beside it: the host's other work goes on
                "intra_op_threads": 1, "spin_wait": "false",
                # the slow batch is no hang (the process backend would restart the inference process)
                "inference_unready_after_s": 600, "inference_kill_after_s": 1200,
                **({"workers": workers} if workers else {})}
    with running_service(**settings) as url, ThreadPoolExecutor(4) as pool:
        computed, queued = figures(url)
        assert queued == 0
        body, headers = v2_body("images", np.stack([BLOCKER, BLOCKER]))
        blocker = pool.submit(httpx.post, f"{url}/v2/models/{MODEL}/infer", content=body, headers=headers, timeout=300)
        # one image in the slow batch, one in the queue: the batch runs, and the blocker's own timeout is ahead
        until(lambda: figures(url)[1] == 1 or blocker.done(), "the blocker's second image queued")
        assert not blocker.done(), blocker.result().text
        waiting = [pool.submit(httpx.post, f"{url}/classify", files=jpegs(WAITING), params={"model": MODEL},
                               timeout=300) for _ in range(3)]
        why = f"no result from {MODEL} within {TIMEOUT_S:g}s"
        for answer in [*(w.result() for w in waiting), blocker.result()]:
            assert answer.status_code == 503, answer.text
            assert answer.headers["Retry-After"] == str(RETRY_AFTER_S)
        assert all(w.result().json()["error"] == {"code": "overloaded", "message": why} for w in waiting)
        assert blocker.result().json() == {"error": why}  # the Open Inference Protocol's shape, under /v2
        # the slow batch's one image is counted when it ends; the 3 x 4 waiting images and the blocker's second
        # left the queue, so nothing runs after it
        until(lambda: figures(url)[0] >= computed + 1, "the slow batch's end", timeout_s=600)
        assert figures(url)[1] == 0
        coffee = photo_bytes("coffee", "JPEG")
        r = httpx.post(f"{url}/classify", files={"file": ("coffee.jpg", coffee)}, params={"model": MODEL, "top_k": 6},
                       timeout=60)
        assert r.status_code == 200, r.text
        got = {p["index"]: p["score"] for p in r.json()["results"][0]["predictions"]}
        np.testing.assert_allclose([got[i] for i in range(6)], direct_probabilities(REPO / "shapes-vit", coffee),
                                   atol=1e-5)
        # the queue is first in, first out: had anything stayed in it, it would have run before this request
        assert figures(url) == (computed + 1 + 1, 0)


@pytest.mark.parametrize("backend,workers", [("thread", 0), ("process", 2)])
def test_a_request_past_its_own_deadline_gets_504_and_its_images_never_reach_a_batch(repository, backend, workers):
    """The same queue behind the slow batch, the server's own timeout far off: each request's deadline drops it. The
    blocker (its parameters.timeout 2 s on /v2) has one image in the slow batch and one in the queue; behind it,
    /classify and /embed with timeout_ms, /v2 with Triton's `timeout` (µs) and gRPC ModelInfer with the same parameter,
    each 1 s. All are answered 504 deadline_exceeded (gRPC DEADLINE_EXCEEDED) before the slow batch ends, and nothing
    but its one image is computed."""
    port = free_port()
    settings = {"backend": backend, "model_repository": repository, "max_batch_size": 1, "request_timeout_s": 600,
                "intra_op_threads": 1, "spin_wait": "false", "grpc_port": port,
                "inference_unready_after_s": 600, "inference_kill_after_s": 1200,
                **({"workers": workers} if workers else {})}
    with running_service(**settings) as url, ThreadPoolExecutor(5) as pool:
        computed, _ = figures(url)
        body, headers = v2_body("images", np.stack([BLOCKER, BLOCKER]), parameters={"timeout": 2_000_000})
        blocker = pool.submit(httpx.post, f"{url}/v2/models/{MODEL}/infer", content=body, headers=headers, timeout=300)
        until(lambda: figures(url)[1] == 1 or blocker.done(), "the blocker's second image queued")
        assert not blocker.done(), blocker.result().text
        classify = pool.submit(httpx.post, f"{url}/classify", files=jpegs(WAITING), timeout=300,
                               params={"model": MODEL, "timeout_ms": 1000})
        embed = pool.submit(httpx.post, f"{url}/embed", files=jpegs(WAITING), timeout=300,
                            params={"model": MODEL, "timeout_ms": 1000})
        body, headers = v2_body("images", np.stack([model_pixels(REPO / "shapes-vit", photo_bytes(name, "JPEG"))
                                                    for name in WAITING]), parameters={"timeout": 1_000_000})
        v2 = pool.submit(httpx.post, f"{url}/v2/models/{MODEL}/infer", content=body, headers=headers, timeout=300)

        def grpc_call() -> str:
            with triton_grpc.InferenceServerClient(f"127.0.0.1:{port}") as client:
                images = triton_grpc.InferInput("images", [1, *BLOCKER.shape], "UINT8")
                images.set_data_from_numpy(BLOCKER[None])
                with pytest.raises(InferenceServerException) as refused:
                    client.infer(MODEL, [images], timeout=1_000_000)
                return refused.value.status()

        grpc = pool.submit(grpc_call)
        assert classify.result().status_code == 504, classify.result().text
        # answered while the slow batch (six times their deadline) still runs: not when it ends, as a queue
        # timeout that waits for the running batch would (Triton's server #7512)
        assert figures(url)[0] == computed
        assert classify.result().json()["error"]["code"] == "deadline_exceeded"
        assert (embed.result().status_code, embed.result().json()["error"]["code"]) == (504, "deadline_exceeded")
        assert v2.result().status_code == blocker.result().status_code == 504
        assert "deadline passed in the queue" in v2.result().json()["error"]
        assert grpc.result() == "StatusCode.DEADLINE_EXCEEDED"
        until(lambda: figures(url)[0] >= computed + 1, "the slow batch's end", timeout_s=600)
        assert figures(url) == (computed + 1, 0)  # the slow batch's one image, and nothing of the expired


@pytest.mark.parametrize("backend,workers", [("thread", 0), ("process", 2)])
def test_a_first_level_request_overtakes_the_queue(repository, backend, workers):
    """On mid-vit (a bright batch of about a tenth of the slow one), one image a batch: a blocker of eight bright
    images on /v2, then three /classify requests of the default level and one of level 1, each the bright astronaut.
    Batches a good part of a second apart: the order of the answers is the order the batches ran. The level-1
    request, sent last, runs next, ahead of the blocker's images still queued; under the thread backend the others
    then in arrival order, after the blocker (under the process backend a worker's requests may wait for its frame
    ahead to be taken, so only the level-1 request's place is asserted there). The model configuration lists the
    levels as Triton does."""
    settings = {"backend": backend, "model_repository": repository, "max_batch_size": 1, "request_timeout_s": 600,
                "intra_op_threads": 1, "spin_wait": "false", "priority_aging_ms": 600_000,
                "inference_unready_after_s": 600, "inference_kill_after_s": 1200,
                **({"workers": workers} if workers else {})}
    astronaut = photo_bytes("astronaut", "JPEG")
    with running_service(**settings) as url, ThreadPoolExecutor(5) as pool:
        config = httpx.get(f"{url}/v2/models/{MID}/config", timeout=30).json()["dynamic_batching"]
        assert (config["priority_levels"], config["default_priority_level"]) == (2, 2)
        answered = []
        body, headers = v2_body("images", np.stack([BLOCKER] * 8))
        blocker = pool.submit(httpx.post, f"{url}/v2/models/{MID}/infer", content=body, headers=headers, timeout=300)
        blocker.add_done_callback(lambda _: answered.append("blocker"))
        until(lambda: figures(url, MID)[1] == 7, "the blocker's first image running, seven queued")
        for i, priority in enumerate((0, 0, 0, 1)):
            answer = pool.submit(httpx.post, f"{url}/classify", files={"file": ("astronaut.jpg", astronaut)},
                                 params={"model": MID, "priority": priority}, timeout=300)
            answer.add_done_callback(lambda _, i=i: answered.append(i))
            # decoded: in the queue a moment later (or, under the process backend, in its worker's outbox)
            until(lambda: decoded(url) == 1 + i, f"request {i} decoded")
        assert blocker.result().status_code == 200
        until(lambda: len(answered) == 5, "every request answered", timeout_s=600)
        assert answered.index(3) < answered.index("blocker")
        assert backend != "thread" or answered == [3, "blocker", 0, 1, 2]


def decoded(url: str) -> float:
    """Images the service has decoded."""
    return metric(httpx.get(f"{url}/metrics", timeout=30).text, "vitserve_decode_seconds_count")
