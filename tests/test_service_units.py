"""Service parts on their own: decoding, preprocessing, the batcher, the attention cache, the import rule."""
import ast
import asyncio
import io
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from skimage import data as photos

from models.data import preprocess as training_preprocess
from service.batching import Batcher, QueueFull
from service.cache import AttentionCache, AttentionRecord
from service.errors import APIError
from service.metrics import Metrics
from service.preprocess import InputPolicy, decode, normalise, prepare, resize_and_crop

ROOT = Path(__file__).resolve().parents[1]
POLICY = InputPolicy((96, 96), 110, "bicubic", (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


def encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_service_preprocessing_equals_the_training_side():
    image = Image.fromarray(photos.chelsea())  # 451 x 300, not square: exercises resize and crop
    spec = type("Spec", (), {"mean": POLICY.mean, "std": POLICY.std})
    want = training_preprocess(image, 96, 96 / 110, "bicubic").float() / 255
    want = ((want - torch.tensor(spec.mean).view(3, 1, 1)) / torch.tensor(spec.std).view(3, 1, 1)).numpy()
    got = normalise(resize_and_crop(image, POLICY), POLICY)
    assert got.shape == (3, 96, 96) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_exif_orientation_is_applied():
    pixels = np.zeros((40, 80, 3), np.uint8)
    pixels[:, :40] = (255, 0, 0)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    image = decode(encode(Image.fromarray(pixels), "JPEG", exif=exif, quality=95), 40, 10**8)
    assert image.size == (40, 80)  # portrait now
    top, bottom = np.asarray(image)[:20].mean((0, 1)), np.asarray(image)[-20:].mean((0, 1))
    assert top[0] > 200 and bottom[2] < 60 and bottom[0] < 60  # the red half turned to the top


@pytest.mark.parametrize("mode,fmt", [("L", "JPEG"), ("CMYK", "JPEG"), ("RGBA", "PNG"), ("P", "PNG"),
                                      ("I;16", "PNG"), ("LA", "PNG")])
def test_image_modes_decode_to_rgb(mode, fmt):
    rgb = Image.fromarray(photos.astronaut()).resize((64, 64))
    if mode == "I;16":
        source = Image.fromarray((np.asarray(rgb.convert("L"), np.uint16) * 257).astype("<u2"))
    else:
        source = rgb.convert(mode)
    image = decode(encode(source, fmt), 64, 10**8)
    assert image.mode == "RGB" and image.size == (64, 64)
    grey = np.asarray(image, np.float32).mean()
    assert 40 < grey < 220, f"{mode}: mean {grey}"  # not blown out or black: 16-bit scaled, alpha on white


def test_transparent_pixels_composite_on_white():
    image = decode(encode(Image.new("RGBA", (8, 8), (0, 0, 0, 0)), "PNG"), 4, 10**8)
    assert np.asarray(image).min() == 255


def test_large_jpeg_decodes_in_draft_mode_but_still_covers_the_input():
    big = Image.fromarray(photos.astronaut()).resize((2048, 1536))
    image = decode(encode(big, "JPEG", quality=90), 110, 10**8)
    assert min(image.size) >= 110 and image.size[0] <= 512  # reduced by the JPEG decoder, not after


def test_bad_inputs_are_4xx():
    with pytest.raises(APIError) as e:
        decode(b"this is not an image", 10, 10**8)
    assert e.value.status == 415
    truncated = encode(Image.fromarray(photos.chelsea()), "JPEG")[:2000]
    with pytest.raises(APIError) as e:
        prepare(truncated, POLICY, 10**8)
    assert e.value.status == 400 and "could not be decoded" in e.value.message
    with pytest.raises(APIError) as e:
        decode(encode(Image.new("RGB", (300, 300)), "PNG"), 10, max_pixels=300 * 299)
    assert e.value.status == 413 and "90000 pixels" in e.value.message


def _run_batcher(coro_fn, **kw):
    async def main():
        calls = []

        def run(x: np.ndarray) -> dict[str, np.ndarray]:
            calls.append(len(x))
            time.sleep(0.02)
            return {"logits": x.reshape(len(x), -1)[:, :2] * 2}

        with ThreadPoolExecutor(1) as pool:
            batcher = Batcher("m", run, pool, Metrics(), **{"max_batch_size": 4, "max_queue_delay_s": 0.05,
                                                            "queue_limit": 16, **kw})
            batcher.start()
            try:
                return await coro_fn(batcher), calls
            finally:
                await batcher.stop()

    return asyncio.run(main())


def test_batcher_fills_batches_and_returns_each_row_to_its_request():
    async def go(batcher):
        xs = [np.full((1, 1, 2), i, np.float32) for i in range(10)]
        return await asyncio.gather(*batcher.submit(xs))

    results, calls = _run_batcher(go)
    assert calls == [4, 4, 2]  # full batches, then the rest at once: no other request is on its way
    assert [r.outputs["logits"][0] for r in results] == [2.0 * i for i in range(10)]
    assert [r.batch_size for r in results] == [4] * 8 + [2] * 2


def test_a_partial_batch_waits_only_while_another_request_is_preparing_and_at_most_the_delay():
    image = np.ones((1, 1, 2), np.float32)

    async def alone(batcher):
        return await batcher.submit([image])[0]

    async def joined(batcher):
        async def slow_decode():
            with batcher.preparing():
                await asyncio.sleep(0.02)
            return await batcher.submit([image])[0]

        late = asyncio.create_task(slow_decode())
        await asyncio.sleep(0)  # it is decoding now
        return await asyncio.gather(batcher.submit([image])[0], late)

    async def abandoned(batcher):
        with batcher.preparing():  # a decode that never delivers (e.g. a broken image)
            return await batcher.submit([image])[0]

    result, calls = _run_batcher(alone, max_queue_delay_s=0.1)
    assert calls == [1] and result.queue_s < 0.05  # nothing else coming: no wait
    results, calls = _run_batcher(joined, max_queue_delay_s=0.1)
    assert calls == [2] and all(r.batch_size == 2 for r in results)
    result, calls = _run_batcher(abandoned, max_queue_delay_s=0.1)
    assert calls == [1] and 0.09 <= result.queue_s < 1.0  # waited for it, but no longer than the delay


def test_batcher_refuses_beyond_its_queue_limit_and_skips_abandoned_requests():
    async def go(batcher):
        with pytest.raises(QueueFull, match="limit is 3"):
            batcher.submit([np.zeros((1, 1, 2), np.float32)] * 4)
        abandoned, kept = batcher.submit([np.zeros((1, 1, 2), np.float32)] * 2)
        abandoned.cancel()
        return await kept

    result, calls = _run_batcher(go, queue_limit=3)
    assert calls == [1] and result.batch_size == 1


def test_attention_cache_is_bounded_by_count_bytes_and_age():
    def record(nbytes: int) -> AttentionRecord:
        return AttentionRecord("m", {"cls_attention": np.zeros(2, np.float32)}, b"x" * nbytes)

    cache = AttentionCache(max_items=3, max_bytes=1000, ttl_s=60)
    for i in range(5):
        cache.put(str(i), record(10))
    assert len(cache) == 3 and cache.get("0") is None and cache.get("4") is not None
    cache.get("2")  # recently used: survives the next eviction
    cache.put("big", record(900))
    assert cache.nbytes <= 1000 and cache.get("2") is not None and cache.get("3") is None
    assert not cache.put("huge", record(2000))
    expiring = AttentionCache(max_items=3, max_bytes=1000, ttl_s=0.01)
    expiring.put("a", record(1))
    time.sleep(0.02)
    assert expiring.get("a") is None and len(expiring) == 0


def test_service_imports_neither_torch_nor_models():
    for path in (ROOT / "service").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            assert not any(n.split(".")[0] in ("torch", "models", "export") for n in names), f"{path}: {names}"
    # and at run time, the whole app and its server entry points load without them
    code = ("import sys, service.app, service.__main__, service.ray_serve; "
            "bad = [m for m in ('torch', 'models', 'export') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
