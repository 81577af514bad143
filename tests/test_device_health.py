"""A failed batch narrowed down to the images that fail (the others answered), and a device that fails every batch
judged broken: counted only for batches of which nothing ran, reset by one that ran, and only past both the count
and the span. Real ONNX Runtime sessions of a graph that fails inside its run on bright images (fault_graphs.py);
the backend in process, its HTTP layer through ASGITransport. The process-level ends (the inference process
replaced, the thread backend's exit) are in test_faults.py."""
import asyncio

import httpx
import numpy as np
import pytest
from fault_graphs import fragile
from service_process import ROOT, model_pixels, photo_bytes

from service.http.app import create_app
from service.engine.backends import Lease, device_health
from service.engine.backends.device_health import DeviceHealth, run_isolating
from service.engine.backends.local import LocalBackend
from service.core.metrics import Metrics
from service.engine.records import record_dtype
from service.engine.runtime import Runner
from service.core.settings import Settings

SOURCE = ROOT / "model_repository" / "shapes-vit"
DARK, BRIGHT = photo_bytes("coffee", "JPEG"), photo_bytes("astronaut", "JPEG")  # top-left pixel 40 / 168 as input


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("fragile")
    fragile(SOURCE, repo / "fragile")
    return repo


@pytest.fixture(scope="module")
def runner(repo) -> Runner:
    return Runner(repo / "fragile" / "model.onnx", ("images", "pixel_values"), ["CPUExecutionProvider"], threads=1)


def plain_logits(images: np.ndarray) -> np.ndarray:
    source = Runner(SOURCE / "model.onnx", ("images", "pixel_values"), ["CPUExecutionProvider"], threads=1)
    return source.run(images, np.zeros((0, 3, *images.shape[1:3]), np.float32))["logits"]


def test_a_failed_batch_is_run_again_in_parts_and_only_the_images_that_fail_fail(runner):
    dark, bright = model_pixels(SOURCE, DARK), model_pixels(SOURCE, BRIGHT)
    images = np.stack([dark, bright, dark // 2, dark, bright])  # 5 rows: 1 and 4 fail
    calls = []

    def run(x, pixel_values):
        calls.append(len(x))
        return runner.run(x, pixel_values)

    outputs, failed = run_isolating(run, images, np.zeros((0, 3, 96, 96), np.float32))
    assert sorted(failed) == [1, 4] and all("Gather" in str(e) for e in failed.values())
    kept = [0, 2, 3]
    np.testing.assert_allclose(outputs["logits"][kept], plain_logits(images[kept]), atol=1e-5)
    assert not outputs["logits"][[1, 4]].any()  # the failed rows are zeros, never another image's answer
    assert calls[0] == 5 and len(calls) <= 2 * 5 - 1


def test_a_batch_that_runs_is_run_once_and_one_where_nothing_runs_raises_its_error(runner):
    dark, bright = model_pixels(SOURCE, DARK), model_pixels(SOURCE, BRIGHT)
    calls = []

    def run(x, pixel_values):
        calls.append(len(x))
        return runner.run(x, pixel_values)

    no_tensors = np.zeros((0, 3, 96, 96), np.float32)
    outputs, failed = run_isolating(run, np.stack([dark, dark]), no_tensors)
    assert calls == [2] and not failed and len(outputs["logits"]) == 2
    with pytest.raises(Exception, match="Gather"):
        run_isolating(runner.run, np.stack([bright, bright, bright]), no_tensors)


def test_the_device_is_broken_only_after_enough_failed_batches_in_a_row_over_the_span(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(device_health.time, "monotonic", lambda: now[0])
    told = []
    health = DeviceHealth(batches=3, span_s=2.0, on_broken=told.append)
    error = RuntimeError("CUDA error: an illegal memory access was encountered")

    def fail_at(*moments: float) -> None:
        for moment in moments:
            now[0] = moment
            health.failed(error)

    fail_at(100.0, 100.1, 100.2, 101.0)  # four in a row, but within 1 s: the batches of one bad moment
    assert health.broken is None and not told
    health.ran()  # one batch ran: the device works
    fail_at(103.0, 103.5, 104.9)  # three in a row, 1.9 s apart
    assert health.broken is None
    fail_at(105.0)  # the count and the span both passed
    assert told == [health.broken] and "4 batches in a row over 2.0s" in health.broken and "illegal" in told[0]
    fail_at(106.0, 107.0)
    assert len(told) == 1  # once
    off = DeviceHealth(batches=0, span_s=0.0, on_broken=told.append)
    for _ in range(10):
        off.failed(error)
    assert off.broken is None  # 0: never


def test_one_bad_image_fails_its_own_request_and_its_batch_mates_are_answered(repo):
    """Two requests in one batch, one of a bright image: ONNX Runtime fails the batch, the dark request gets its
    answer and the bright one its error; no failure counts against the device."""
    async def main():
        backend = LocalBackend(Settings(model_repository=repo, warmup_runs=0, max_batch_size=8), Metrics())
        await backend.start()
        await backend.loaded()
        try:
            records = [np.empty(1, record_dtype(backend.models.by_key["fragile"], "image")) for _ in range(2)]
            records[0]["image"][0], records[1]["image"][0] = model_pixels(SOURCE, DARK), model_pixels(SOURCE, BRIGHT)
            # both submitted in one turn of the event loop: the batcher gathers them into one batch
            answers = await asyncio.gather(*(backend.run("fragile", Lease(r), 1) for r in records),
                                           return_exceptions=True)
            return records, answers, backend.health.failures
        finally:
            await backend.close()

    records, (dark, bright), failures = asyncio.run(main())
    assert dark is None and records[0]["batch_size"][0] == 2  # answered, from a batch of both
    np.testing.assert_allclose(records[0]["logits"], plain_logits(records[0]["image"]), atol=1e-5)
    assert bright.code == "inference_failed" and "Gather" in bright.message
    assert failures == 0


def test_a_broken_device_turns_readiness_and_requests_to_503_device_failed(repo):
    """Bright images only, the span 0: the third failed batch breaks the device; the backend tells its process
    once, and readiness and every request answer 503 with the reason and Retry-After."""
    settings = Settings(model_repository=repo, warmup_runs=0, device_broken_batches=3, device_broken_s=0)
    told = []
    backend = LocalBackend(settings, Metrics(), on_broken=told.append)

    async def main():
        app = create_app(settings, backend, metrics=Metrics())
        async with app.router.lifespan_context(app):
            await backend.loaded()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://vitserve") as client:
                ready_before = (await client.get("/health/ready")).status_code
                answers = [await client.post("/classify", files={"file": ("a.jpg", BRIGHT)}) for _ in range(4)]
                return ready_before, answers, await client.get("/health/ready")

    ready_before, answers, ready = asyncio.run(main())
    assert ready_before == 200
    assert [a.status_code for a in answers] == [500, 500, 500, 503], [a.text for a in answers]
    assert answers[0].json()["error"]["code"] == "inference_failed"
    for answer in (answers[3], ready):
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "device_failed", answer.text
        assert "failed 3 batches in a row" in answer.json()["error"]["message"]
        assert answer.headers["retry-after"] == "1"
    assert len(told) == 1
