"""Decoding JPEGs with their batch, as the GPU path does, checked on the CPU: the resize weights against Pillow,
and the "jpeg" records' way through the batcher, the backends and the process boundary, with a decoder that
does on the host what gpu_decode.GpuDecoder does on the device (the GPU itself: tests/test_gpu.py)."""
import asyncio
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image
from service_process import ROOT, model_pixels, photo_bytes, run_graph
from skimage import data as photos

from repository import InputPolicy
from service.backends.local import LocalBackend
from service.backends.process import ProcessBackend
from service.backends.server import InferenceServer
from service.decode import resize_and_crop
from service.errors import BadInput
from service.gpu_decode import crop_weights, is_jpeg, resize
from service.metrics import Metrics
from service.pipeline import Pipeline
from service.settings import Settings

REPO = ROOT / "model_repository"


@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear", "lanczos"])
@pytest.mark.parametrize("size,short", [((96, 96), 96), ((224, 224), 248), ((112, 112), 128)])
def test_the_matrix_resize_is_pillows_within_one_level(interpolation, size, short):
    policy = InputPolicy(size, short, interpolation, (0.5,) * 3, (0.5,) * 3)
    for name in ("chelsea", "astronaut", "coffee", "rocket"):
        image = Image.fromarray(getattr(photos, name)()).convert("RGB")
        want = np.asarray(resize_and_crop(image, policy)).astype(int)
        got = resize(np.asarray(image), *crop_weights(policy, *image.size)).astype(int)
        assert got.shape == (*size, 3) and np.abs(got - want).max() <= 1, name
        assert np.abs(got - want).mean() < 0.05  # off by one only where Pillow's fixed-point rounding ties


class HostDecoder:
    """gpu_decode.GpuDecoder's interface and arithmetic, on the host: full-size decode, then the matrix resize."""

    def __init__(self, policy: InputPolicy):
        self.policy, self.calls = policy, []

    def decode(self, jpegs, fallback):
        self.calls.append(len(jpegs))
        out, errors = np.zeros((len(jpegs), *self.policy.size, 3), np.uint8), {}
        for i, data in enumerate(jpegs):
            try:
                pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
                out[i] = resize(pixels, *crop_weights(self.policy, pixels.shape[1], pixels.shape[0]))
            except OSError:  # what nvImageCodec refuses goes to Pillow
                try:
                    out[i] = fallback(data)
                except Exception as e:  # noqa: BLE001
                    errors[i] = e
        return out, errors

    def join(self, decoded, host):
        return np.concatenate([decoded, host])


def settings(**kw) -> Settings:
    # the host decoder stands in for nvImageCodec, which a GPU host would otherwise give every model
    return Settings(model_repository=REPO, warmup_runs=0, gpu_decode=False, **kw)


def test_jpegs_decoded_with_their_batch_give_the_cpu_paths_answers_and_a_bad_one_fails_alone():
    jpegs = [photo_bytes(name, "JPEG", quality=90) for name in ("chelsea", "coffee", "rocket")]
    assert all(map(is_jpeg, jpegs)) and not is_jpeg(photo_bytes("chelsea", "PNG"))
    pixels = np.stack([model_pixels(REPO / "shapes-vit", j) for j in jpegs])
    want = run_graph(REPO / "shapes-vit" / "model.onnx", pixels)

    async def main():
        backend = LocalBackend(settings(max_queue_delay_ms=50), Metrics())
        await backend.start()
        await backend.loaded()
        vit = next(e for e in backend.entries if e.name == "shapes-vit")
        decoder = HostDecoder(vit.policy)
        backend.use_jpeg_decoder("shapes-vit", decoder)
        assert backend.status()["shapes-vit"].decode == "gpu" and backend.status()["shapes-deit"].decode == "cpu"
        with ThreadPoolExecutor(2) as pool:
            pipeline = Pipeline(vit, backend, pool, backend.settings, Metrics())
            good, bad, png = await asyncio.gather(
                pipeline.images(jpegs, top_k=3), pipeline.images([jpegs[0][:2000]]),
                pipeline.images([photo_bytes("chelsea", "PNG")]), return_exceptions=True)
        await backend.close()
        return good, bad, png, decoder.calls

    good, bad, png, calls = asyncio.run(main())
    assert calls == [4]  # the three JPEGs and the broken one; the PNG, decoded on the CPU, joined their batch
    assert png.fields["batch_size"][0] == good.fields["batch_size"][0] == 5
    assert isinstance(bad, BadInput) and "could not be decoded" in bad.message  # its own request fails, alone
    assert (good.fields["logits"].argmax(1) == want[0].argmax(1)).all()
    # full-size decode + resize on the "GPU" vs Pillow's draft-mode decode: close, not identical
    np.testing.assert_allclose(good.fields["logits"], want[0], atol=0.5)


def test_jpeg_bytes_cross_to_the_inference_process_beside_their_records(tmp_path):
    """Two requests in one frame, one with a JPEG no decoder reads: that one fails alone."""
    jpeg = photo_bytes("chelsea", "JPEG", quality=90)

    async def run(worker: ProcessBackend, jpegs: list[bytes]) -> np.ndarray:
        with worker.records("shapes-deit", "jpeg", len(jpegs)) as records:
            assert "image" not in records.dtype.names
            await worker.run("shapes-deit", records, 2, jpegs)
            return records["logits"].copy()

    async def main():
        stop = asyncio.Event()
        server = InferenceServer(settings(), tmp_path / "inference.sock")
        serving = asyncio.create_task(server.serve(stop))
        worker = ProcessBackend(settings(), tmp_path / "inference.sock")
        try:
            await worker.start()
            await worker.loaded()
            decoder = HostDecoder(next(e for e in server.backend.entries if e.name == "shapes-deit").policy)
            server.backend.use_jpeg_decoder("shapes-deit", decoder)  # pushed to the worker as status
            for _ in range(100):
                if worker.status()["shapes-deit"].decode == "gpu":
                    break
                await asyncio.sleep(0.01)
            else:
                pytest.fail("the decoder's status never reached the worker")
            logits, broken = await asyncio.gather(run(worker, [jpeg, jpeg]), run(worker, [jpeg[:2000]]),
                                                  return_exceptions=True)
            return logits, broken, decoder.calls
        finally:
            await worker.close()
            stop.set()
            await serving

    logits, broken, calls = asyncio.run(main())
    direct = run_graph(REPO / "shapes-deit" / "model.onnx", model_pixels(REPO / "shapes-deit", jpeg)[None])[0]
    assert calls == [3] and logits.shape == (2, 6) and (logits.argmax(1) == direct.argmax(1)).all()
    assert isinstance(broken, BadInput) and "could not be decoded" in broken.message
