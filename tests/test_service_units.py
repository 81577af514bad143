"""Service parts on their own: decoding, preprocessing (in the graph), records, the batcher, the serving plan,
errors, the attention cache, and the import rules."""
import ast
import asyncio
import collections
import dataclasses
import io
import json
import logging
import random
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import simplejpeg
from PIL import Image
from starlette.responses import PlainTextResponse
from service_process import photo_bytes, run_graph
from skimage import data as photos

from models.data import preprocess as training_preprocess
from repository import InputPolicy, ModelEntry, read_entry
from service.engine.backends.board import Boards
from service.engine.batching import Batcher, BatchingPolicy, QueueFull
from service.images.avif_header import largest_frame
from service.explain.cache import AttentionCache, AttentionResult
from service.images.decode import decode, decode_size, model_input, resize_and_crop, upload_input
from service.core.errors import (BadInput, ServiceError, TooLarge, Unavailable, UnsupportedMedia, from_wire, overloaded,
                                 to_wire)
from service.engine.heads import head, top_k
from service.http.server import WriteCombining
from service.core.metrics import Metrics
from service.http.middleware import BodyLimit, CancelOnDisconnect
from service.engine.records import Part, host_inputs, record_dtype, spans, write_results
from service.engine.runtime import CPU, CUDA, Runner, graph_batches, open_session, serving_plan

ROOT = Path(__file__).resolve().parents[1]
REPO = ROOT / "model_repository"
POLICY = InputPolicy((96, 96), 110, "bicubic", (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


def encode(image: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


# -- decoding and preprocessing --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["chelsea", "astronaut", "coffee", "rocket"])  # not square: resize and crop
def test_the_reference_preprocessing_equals_the_training_side(name):
    image = Image.fromarray(getattr(photos, name)())
    want = training_preprocess(image, 96, 96 / 110, "bicubic").permute(1, 2, 0).numpy().astype(int)
    got = np.asarray(resize_and_crop(image, POLICY))
    assert got.shape == (96, 96, 3) and got.dtype == np.uint8
    # the crop's region resized alone: the same filter positions, so off by one level at most, and rarely (float
    # rounding of the region's edges)
    difference = np.abs(got.astype(int) - want)
    assert difference.max() <= 1 and (difference > 0).mean() < 0.005


@pytest.mark.parametrize("size,short", [(96, 110), (112, 128), (224, 249), (384, 438)])
@pytest.mark.parametrize("name", ["chelsea", "astronaut", "coffee", "rocket", "hubble_deep_field"])
def test_the_fast_preprocessing_stays_within_its_tolerance_of_the_reference(name, size, short):
    """What the service sends (model_input: OpenCV's bilinear warp of the crop, after a box reduction where the
    photo shrinks 2x or more) against Pillow's bicubic resample (resize_and_crop), on real photos decoded as the
    service decodes JPEGs (draft mode): the tolerance docs/models.md states. Where nothing is resampled (a photo
    already at the resized size) the two are the same pixels: the warp's geometry is exact."""
    policy = InputPolicy((size, size), short, "bicubic", POLICY.mean, POLICY.std)
    image = decode(photo_bytes(name, "JPEG", quality=90), short, 10**8).image
    got, want = model_input(image, policy), np.asarray(resize_and_crop(image, policy))
    assert got.shape == want.shape == (size, size, 3) and got.dtype == np.uint8
    difference = np.abs(got.astype(int) - want)
    assert difference.mean() <= 3 and np.percentile(difference, 99) <= 25, (difference.mean(), difference.max())
    square = image.resize((short, short))  # resized already: the crop alone
    np.testing.assert_array_equal(model_input(square, policy), np.asarray(resize_and_crop(square, policy)))


@pytest.mark.parametrize("name", ["shapes-vit", "shapes-deit", "shapes-swin", "expression-vit", "expression-fer2013"])
def test_normalising_in_the_graph_gives_the_answers_of_normalising_on_the_cpu(name):
    """The service sends uint8 pixels; before, it sent (x / 255 - mean) / std computed on the CPU. Same answers."""
    policy = read_entry(REPO / name).policy
    pixels = np.stack([model_input(Image.fromarray(getattr(photos, p)()).convert("RGB"), policy)
                       for p in ("chelsea", "astronaut", "coffee", "rocket")])
    mean, std = np.asarray(policy.mean, np.float32), np.asarray(policy.std, np.float32)
    cpu = ((pixels.astype(np.float32) / 255.0 - mean) / std).transpose(0, 3, 1, 2).copy()  # the old service code
    np.testing.assert_allclose(policy.normalise(pixels), cpu, atol=1e-6)
    in_graph, on_cpu = run_graph(REPO / name / "model.onnx", pixels), run_graph(REPO / name / "model.onnx", cpu)
    for got, want in zip(in_graph, on_cpu):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert (in_graph[0].argmax(1) == on_cpu[0].argmax(1)).all()
    # both inputs in one run (a batch of uploads and v2 tensors): the images' rows first, each as alone
    session = ort.InferenceSession(REPO / name / "model.onnx", providers=[CPU])
    mixed = session.run(None, {"images": pixels[:3], "pixel_values": cpu[1:]})
    for got, images, tensors in zip(mixed, in_graph, on_cpu):
        np.testing.assert_allclose(got, np.concatenate([images[:3], tensors[1:]]), atol=1e-5)


def test_exif_orientation_is_applied_and_the_upright_size_reported():
    pixels = np.zeros((40, 80, 3), np.uint8)
    pixels[:, :40] = (255, 0, 0)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    photo = decode(encode(Image.fromarray(pixels), "JPEG", exif=exif, quality=95), 40, 10**8)
    assert photo.image.size == (40, 80) and photo.size == (40, 80)  # portrait now
    top, bottom = np.asarray(photo.image)[:20].mean((0, 1)), np.asarray(photo.image)[-20:].mean((0, 1))
    assert top[0] > 200 and bottom[2] < 60 and bottom[0] < 60  # the red half turned to the top


def test_an_iphone_heic_decodes_upright_once_and_its_pixels_are_counted_from_its_header():
    heic = (Path(__file__).parent / "reference" / "chelsea_iphone.heic").read_bytes()  # stored turned (irot, EXIF 6)
    assert decode_size(heic, 10**8) == (451, 300)
    with pytest.raises(TooLarge, match="451x300"):
        upload_input(heic, POLICY, 451 * 300 - 1)
    photo = decode(heic, None, 10**8)
    assert photo.size == photo.image.size == (451, 300)  # turned by libheif, and not once more by its EXIF
    assert np.abs(np.asarray(photo.image, np.int16) - photos.chelsea()).mean() < 3  # HEVC at quality 60
    np.testing.assert_array_equal(upload_input(heic, POLICY, 10**8), model_input(photo.image, POLICY))


def avif(frames: list[Image.Image], **options) -> bytes:
    buf = io.BytesIO()
    frames[0].save(buf, "AVIF", save_all=len(frames) > 1, append_images=frames[1:], speed=10, **options)
    return buf.getvalue()


def test_an_avifs_largest_frame_is_read_from_its_av1_data_and_a_damaged_one_is_a_value_error():
    """Stills carry a reduced sequence header, their size exactly; a sequence's frames are its full sequence header's
    maximum where their frame headers do not override it. Mutated and cut files raise ValueError and nothing else."""
    rgba = np.zeros((300, 200, 4), np.uint8)
    rgba[..., 3] = 128
    files = {"still": (avif([Image.new("RGB", (333, 517), "grey")]), (333, 517)),
             "4:4:4": (avif([Image.new("RGB", (4001, 3), "grey")], subsampling="4:4:4"), (4001, 3)),
             "alpha": (avif([Image.fromarray(rgba)]), (200, 300)),
             "sequence": (avif([Image.new("RGB", (200, 120), (40 * i, 0, 0)) for i in range(3)]), (200, 120))}
    for name, (data, size) in files.items():
        assert largest_frame(data) == size, name
    assert largest_frame((Path(__file__).parent / "reference" / "flat_12000.avif").read_bytes()) == (12000, 12000)
    rng = random.Random(0)
    for _ in range(3000):
        damaged = bytearray(rng.choice([data for data, _ in files.values()]))
        for _ in range(rng.randint(1, 4)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        try:
            largest_frame(bytes(damaged[:rng.randrange(len(damaged))] if rng.random() < 0.2 else damaged))
        except ValueError:
            pass
    with pytest.raises(ValueError, match="no AV1"):  # a HEIF whose image is HEVC
        largest_frame((Path(__file__).parent / "reference" / "chelsea_iphone.heic").read_bytes())


def test_a_damaged_exif_directory_still_decodes_upright():
    """A text where a resolution (a RATIONAL) should be: Pillow reads the directory, and its exif_transpose failed
    writing it back (TypeError: a 500). The photo is turned by its orientation, and the directory left alone."""
    exif = Image.Exif()
    exif.update({0x010F: "Maker", 0x0112: 6})
    data = encode(Image.fromarray(photos.chelsea()), "JPEG", exif=exif)
    data = data.replace(b"\x01\x0f\x00\x02", b"\x01\x1a\x00\x02", 1)  # Make's tag (big-endian) -> XResolution's
    assert Image.open(io.BytesIO(data)).getexif()[0x011A] == "Maker"
    photo = decode(data, None, 10**8)
    assert photo.image.size == photo.size == (300, 451)
    plain = decode(encode(Image.fromarray(photos.chelsea()), "JPEG"), None, 10**8).image  # the same scan
    np.testing.assert_array_equal(np.asarray(photo.image), np.asarray(plain.transpose(Image.Transpose.ROTATE_270)))


def damaged_image_seeds() -> list[tuple[bytes, int]]:
    """Real photos in every format the service takes, with EXIF where the format carries it: (bytes, how far in
    the damage goes: a JPEG's header and the start of its scan, the first 400 bytes of the others)."""
    exif = Image.Exif()
    exif.update({0x010F: "Maker", 0x0110: "Model", 0x0112: 6})
    photo, seeds = Image.fromarray(photos.chelsea()), []
    for mode, kw in (("RGB", {"exif": exif}), ("L", {"exif": exif, "progressive": True}),
                     ("RGB", {"xmp": b'<x tiff:Orientation="8"/>'}), ("CMYK", {})):
        data = encode(photo.convert(mode), "JPEG", **kw)
        seeds.append((data, data.index(b"\xff\xda") + 40))
    small = photo.resize((120, 80))
    for fmt, image, kw in (("PNG", small, {"exif": exif}), ("PNG", small.convert("RGBA"), {}),
                           ("PNG", small.convert("P"), {}), ("PNG", small.convert("L").convert("I;16"), {}),
                           ("WEBP", small, {"exif": exif}), ("GIF", small.convert("P"), {}),
                           ("TIFF", small, {"exif": exif}),
                           ("TIFF", small.convert("CMYK"), {"compression": "tiff_lzw"}),
                           ("BMP", small, {})):
        seeds.append((encode(image, fmt, **kw), 400))
    return seeds


@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow's, on the damaged EXIF it reads
def test_damaged_images_are_refused_with_the_services_errors_only():
    """1,200 images damaged at random (bytes changed, cut out or put in, in a JPEG's markers, EXIF, XMP and tables,
    in the others' first 400 bytes), through each decode the routes use: every one decodes or is a BadInput /
    UnsupportedMedia / TooLarge (a 4xx), never another exception (a 500). Such runs found a TypeError of Pillow's
    exif_transpose and a decode left lazy, failing where its pixels were read."""
    rng, seeds = random.Random(0), damaged_image_seeds()
    reads = (lambda data: upload_input(data, POLICY, 10**8), lambda data: decode(data, 110, 10**8),
             lambda data: decode_size(data, 10**8))
    outcomes = collections.Counter()
    for _ in range(1200):
        data, reach = rng.choice(seeds)
        data, at = bytearray(data), rng.randrange(2, reach)
        if (how := rng.random()) < 0.6:
            for _ in range(rng.randint(1, 6)):
                data[rng.randrange(2, at + 1)] = rng.randrange(256)
        elif how < 0.8:
            del data[at:at + rng.randint(1, 40)]
        else:
            data[at:at] = rng.randbytes(rng.randint(1, 40))
        for read in reads:
            try:
                read(bytes(data))
                outcomes["decoded"] += 1
            except (BadInput, UnsupportedMedia, TooLarge) as e:
                outcomes[type(e).__name__] += 1
    assert outcomes["decoded"] > 500 and outcomes["BadInput"] > 100, outcomes  # both ways, often


@pytest.mark.parametrize("mode,fmt", [("L", "JPEG"), ("CMYK", "JPEG"), ("RGBA", "PNG"), ("P", "PNG"),
                                      ("I;16", "PNG"), ("LA", "PNG")])
def test_image_modes_decode_to_rgb(mode, fmt):
    rgb = Image.fromarray(photos.astronaut()).resize((64, 64))
    if mode == "I;16":
        source = Image.fromarray((np.asarray(rgb.convert("L"), np.uint16) * 257).astype("<u2"))
    else:
        source = rgb.convert(mode)
    image = decode(encode(source, fmt), 64, 10**8).image
    assert image.mode == "RGB" and image.size == (64, 64)
    # the photo as it was before it was stored in that mode: grey modes hold its grey (16 bits: the grey x 257),
    # a palette its palette's colours; RGBA is opaque here, so composited on white it is the photo
    grey = rgb.convert("L").convert("RGB")
    want = {"L": grey, "I;16": grey, "LA": grey, "P": source.convert("RGB")}.get(mode, rgb)
    difference = np.abs(np.asarray(image, int) - np.asarray(want, int)).mean()
    # JPEG at quality 75 moves a 64 x 64 photo's pixels 5 levels on average; PNG keeps them. An inverted CMYK
    # decode is 138 levels off, its channels in another order 34, a 16-bit image cut instead of scaled 115
    assert difference < (8 if fmt == "JPEG" else 0.5), f"{mode}: {difference:.1f} levels from the photo on average"


def test_transparent_pixels_composite_on_white():
    image = decode(encode(Image.new("RGBA", (8, 8), (0, 0, 0, 0)), "PNG"), 4, 10**8).image
    assert np.asarray(image).min() == 255


def test_large_jpeg_decodes_in_draft_mode_but_still_covers_the_input():
    big = Image.fromarray(photos.astronaut()).resize((2048, 1536))
    photo = decode(encode(big, "JPEG", quality=90), 110, 10**8)
    assert min(photo.image.size) >= 110 and photo.image.size[0] <= 512  # reduced by the JPEG decoder, not after
    assert photo.size == (2048, 1536)  # what was uploaded


def test_bad_inputs_are_domain_errors():
    with pytest.raises(UnsupportedMedia):
        decode(b"this is not an image", 10, 10**8)
    with pytest.raises(BadInput, match="could not be decoded"):
        truncated = encode(Image.fromarray(photos.chelsea()), "JPEG")[:2000]
        model_input(decode(truncated, 96, 10**8).image, POLICY)
    with pytest.raises(TooLarge, match="90000 pixels") as e:
        decode(encode(Image.new("RGB", (300, 300)), "PNG"), 10, max_pixels=300 * 299)
    assert e.value.code == "image_too_large"


@pytest.mark.parametrize("size", [None, (1600, 1200), (3000, 700), (4000, 3000)])
def test_jpegs_decoded_into_numpy_give_the_pillow_paths_input_bit_for_bit(size, monkeypatch):
    """upload_input decodes colour and grey JPEGs with simplejpeg, reduced (draft) and turned upright by itself:
    the same pixels as Pillow's decode (draft mode, exif_transpose), for every EXIF orientation and reduction."""
    policy = InputPolicy((224, 224), 249, "bicubic", POLICY.mean, POLICY.std)
    decoded, decode_jpeg = [], simplejpeg.decode_jpeg
    monkeypatch.setattr(simplejpeg, "decode_jpeg", lambda *a, **kw: decoded.append(a) or decode_jpeg(*a, **kw))
    for name in ("chelsea", "camera"):  # colour, grey
        photo = Image.fromarray(getattr(photos, name)())
        photo = photo.resize(size) if size else photo
        for orientation in range(1, 9):
            exif = Image.Exif()
            exif[0x0112] = orientation
            data = encode(photo, "JPEG", quality=90, exif=exif)
            want = model_input(decode(data, policy.resize_short_side, 10**8).image, policy)
            np.testing.assert_array_equal(upload_input(data, policy, 10**8), want, f"{name} {orientation}")
    assert len(decoded) == 16  # each by simplejpeg, none through Pillow


@pytest.mark.parametrize("size", [(1, 1), (3, 2), (1, 500), (109, 2000)])
def test_jpegs_smaller_than_the_input_decode_as_pillow_decodes_them(size):
    """No draft reduction where a side is under the policy's short side (a StopIteration there, raised in the
    decode pool, left its request unanswered: asyncio cannot carry it)."""
    for mode in ("L", "RGB"):
        data = encode(Image.fromarray(photos.astronaut()).resize(size).convert(mode), "JPEG")
        want = model_input(decode(data, POLICY.resize_short_side, 10**8).image, POLICY)
        np.testing.assert_array_equal(upload_input(data, POLICY, 10**8), want)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_a_panorama_wider_than_opencv_takes_is_sampled_from_the_crops_window(fmt):
    """40,000 x 90 (3.6 MP, within the pixel limit): OpenCV's warp refuses a source of 32,767 pixels a side, and
    was a 500 here; it is given the window the crop samples, the reference's pixels within the tolerance."""
    policy = InputPolicy((224, 224), 249, "bicubic", POLICY.mean, POLICY.std)
    data = encode(Image.fromarray(photos.astronaut()).resize((40_000, 90)), fmt)
    got = upload_input(data, policy, 10**8)
    want = np.asarray(resize_and_crop(decode(data, policy.resize_short_side, 10**8).image, policy))
    difference = np.abs(got.astype(int) - want)
    assert got.shape == (224, 224, 3) and difference.mean() <= 3, difference.mean()


@pytest.mark.parametrize("mode,fmt", [("CMYK", "JPEG"), ("RGB", "PNG"), ("RGBA", "WEBP")])
def test_what_simplejpeg_does_not_take_goes_through_pillow(mode, fmt):
    photo = Image.fromarray(photos.astronaut()).resize((300, 200)).convert(mode)
    data = encode(photo, fmt)
    want = model_input(decode(data, POLICY.resize_short_side, 10**8).image, POLICY)
    np.testing.assert_array_equal(upload_input(data, POLICY, 10**8), want)


def test_a_jpeg_libjpeg_turbo_reads_with_warnings_gets_pillows_answer():
    """A cut JPEG: Pillow's error (simplejpeg's strict decode refuses it and Pillow decides), and a size limit
    checked from the header before anything is decoded."""
    truncated = encode(Image.fromarray(photos.chelsea()), "JPEG")[:2000]
    with pytest.raises(BadInput, match="could not be decoded"):
        upload_input(truncated, POLICY, 10**8)
    with pytest.raises(TooLarge, match="135300 pixels"):
        upload_input(encode(Image.fromarray(photos.chelsea()), "JPEG"), POLICY, 451 * 299)


def test_errors_cross_processes_by_kind():
    error = from_wire(json.loads(json.dumps(to_wire(overloaded("queue full", 2)))))
    assert isinstance(error, Unavailable) and (error.code, error.message, error.retry_after_s) == (
        "overloaded", "queue full", 2)


# -- records and batches ---------------------------------------------------------------------------------------

def entry() -> ModelEntry:
    return read_entry(REPO / "shapes-deit")


def test_top_k_is_the_sorted_best_with_ties_by_index():
    probs = np.array([[0.1, 0.4, 0.1, 0.4], [0.7, 0.1, 0.1, 0.1]], np.float32)
    index, score = top_k(probs, 3)
    assert index.tolist() == [[1, 3, 0], [0, 1, 2]] and score[0].tolist() == pytest.approx([0.4, 0.4, 0.1])
    rng = np.random.default_rng(0).random((64, 1000)).astype(np.float32)
    index, _ = top_k(rng, 5)
    np.testing.assert_array_equal(index, np.argsort(-rng, axis=1, kind="stable")[:, :5])


def test_a_batch_writes_each_request_its_own_rows_images_first():
    """Two requests of images and one of tensors, run as one batch: each record gets its own rows."""
    images = [np.zeros(2, record_dtype(entry(), "image")), np.zeros(1, record_dtype(entry(), "image"))]
    tensors = np.zeros(3, record_dtype(entry(), "tensor"))
    parts = [Part(images[0], slice(0, 2), 2), Part(images[1], slice(0, 1), 1), Part(tensors, np.array([1, 2]), 6)]
    logits = np.arange(5 * 6, dtype=np.float32).reshape(5, 6) % 7
    outputs = {"logits": logits, "cls_attention": np.random.default_rng(0).random((5, 4, 144), np.float32),
               "dist_attention": np.zeros((5, 4, 144), np.float32)}
    write_results(spans(parts), outputs, [1.0, 2.0, 3.0], 9.0, 0.0, head(entry()))
    np.testing.assert_array_equal(images[0]["logits"], logits[0:2])
    np.testing.assert_array_equal(images[1]["cls_attention"][0], outputs["cls_attention"][2])
    np.testing.assert_array_equal(tensors["logits"][1:], logits[3:5])
    assert tensors["logits"][0].sum() == 0  # not in the batch
    assert images[1]["queue_ms"][0] == 2.0 and tensors["batch_size"][2] == 5 and tensors["inference_ms"][1] == 9
    probs = tensors["probs"][2]
    assert probs.sum() == pytest.approx(1) and tensors["top_index"][2, 0] == logits[4].argmax()


def test_a_batch_of_requests_that_ask_for_no_labels_gets_the_outputs_alone_and_a_multi_label_head_sigmoids():
    """KServe v2 requests (top_k 0) get the graph's outputs: no scores are made for them; beside a request that
    asks for labels, every row gets them, from the model's head (a sigmoid per label here)."""
    tensors = np.zeros(2, record_dtype(entry(), "tensor"))
    logits = np.array([[-800.0, 0, 3, 1, 2, 0], [5, 0, 0, 0, 0, 9]], np.float32)
    outputs = {"logits": logits, "cls_attention": np.zeros((2, 4, 144), np.float32),
               "dist_attention": np.zeros((2, 4, 144), np.float32)}
    write_results(spans([Part(tensors, slice(0, 2), 0)]), outputs, [1.0], 9.0, 0.0, head(entry()))
    np.testing.assert_array_equal(tensors["logits"], logits)
    assert not tensors["probs"].any() and not tensors["top_index"].any()
    sigmoid = dataclasses.replace(head(entry()), scores="sigmoid")
    write_results(spans([Part(tensors, slice(0, 1), 0), Part(tensors, slice(1, 2), 2)]), outputs, [1.0, 1.0], 9.0,
                  0.0, sigmoid)
    with np.errstate(over="ignore"):  # e^800: inf, and 1 / inf the 0 expected
        np.testing.assert_allclose(tensors["probs"], 1 / (1 + np.exp(-logits.astype(np.float64))), atol=1e-6)
    assert tensors["top_index"][:, :2].tolist() == [[2, 4], [5, 0]] and not tensors["top_index"][:, 2:].any()


def test_a_batch_gathers_its_images_in_the_parts_order_into_the_buffer_it_is_given():
    first, second = images(1, 2, 3), images(4, 5)
    tensors = np.zeros(2, record_dtype(entry(), "tensor"))
    tensors["tensor"] = 7
    buffer = np.zeros((8, *first["image"].shape[1:]), np.uint8)  # as Runner.host_batch's page-locked one
    parts = [Part(first, slice(1, 3), 1), Part(tensors, slice(0, 2), 1), Part(second, np.array([0]), 1)]
    gathered, pixels = host_inputs(spans(parts), entry().policy.size, lambda n: buffer[:n])
    assert np.shares_memory(gathered, buffer) and gathered[:, 0, 0, 0].tolist() == [2, 3, 4]
    assert pixels.shape == (2, *tensors["tensor"].shape[1:]) and (pixels == 7).all()


class Gate:
    """Holds the batches `_run_batcher` runs: `entered` is set once one has started, and it runs on (and so does
    every later one) once `go` is set."""

    def __init__(self):
        self.entered, self.go = threading.Event(), threading.Event()

    async def running(self) -> None:
        """Until a batch has started (its parts taken out of the queue)."""
        assert await asyncio.get_running_loop().run_in_executor(None, self.entered.wait, 60), "no batch started"


def _run_batcher(coro_fn, gate: Gate | None = None, **kw):
    async def main():
        calls = []

        def run(parts: list[Part], queue_ms: list[float]) -> float:
            calls.append(sum(p.size for p in parts))
            if gate is not None:
                gate.entered.set()
                gate.go.wait()
            time.sleep(0.02)
            for p, waited in zip(parts, queue_ms):
                p.records["logits"][p.rows, 0] = p.records["image"][p.rows, 0, 0, 0] * 2.0
                p.records["batch_size"][p.rows] = calls[-1]
                p.records["queue_ms"][p.rows] = waited
            return 0.02

        with ThreadPoolExecutor(1) as pool:
            policy = {"max_batch_size": 4, "max_queue_delay_s": 0.05, "queue_limit": 16, **kw}
            coming = policy.pop("coming", lambda: 0)
            batcher = Batcher("m", run, pool, Metrics(), BatchingPolicy(**policy), coming=coming)
            batcher.start()
            try:
                return await coro_fn(batcher), calls
            finally:
                await batcher.stop()

    return asyncio.run(main())


def images(*values: int) -> np.ndarray:
    records = np.zeros(len(values), record_dtype(entry(), "image"))
    records["image"] = np.asarray(values, np.uint8)[:, None, None, None]
    return records


def test_batcher_fills_batches_splits_a_large_request_and_writes_each_row_back():
    async def go(batcher):
        big, small = images(*range(6)), images(10, 11, 12, 13)
        await asyncio.gather(batcher.submit(big).future, batcher.submit(small).future)
        return big, small

    (big, small), calls = _run_batcher(go)
    assert calls == [4, 4, 2]  # the 6 split over two batches, then the rest at once: nothing else is coming
    assert big["logits"][:, 0].tolist() == [0, 2, 4, 6, 8, 10] and small["logits"][:, 0].tolist() == [20, 22, 24, 26]
    assert big["batch_size"].tolist() == [4] * 4 + [4] * 2 and small["batch_size"].tolist() == [4, 4, 2, 2]


@pytest.mark.parametrize("aging_s", [60.0, 0.0])
def test_a_first_level_request_is_taken_first_unless_the_others_have_waited_the_aging(aging_s):
    """One image per batch, the first held running: behind it two requests of the default level, then one of level
    1 and one of level 2 of 3. With the aging far off, level 1 runs next, then level 2, then the default level in
    arrival order; with an aging of 0 every waiting image counts as first-level at once: arrival order."""
    gate = Gate()

    async def go(batcher):
        first = batcher.submit(images(0))
        await gate.running()
        waiting = [batcher.submit(images(value), priority=priority) for value, priority in
                   ((1, 0), (2, 0), (3, 1), (4, 2))]
        gate.go.set()
        done = []
        for entry, value in zip([first, *waiting], range(5)):
            entry.future.add_done_callback(lambda f, value=value: done.append(value))
        await asyncio.gather(first.future, *(e.future for e in waiting))
        return done

    order, _ = _run_batcher(go, gate, max_batch_size=1, aging_s=aging_s)
    assert order == ([0, 3, 4, 1, 2] if aging_s else [0, 1, 2, 3, 4])


def test_a_partial_batch_waits_only_while_another_request_is_preparing_and_at_most_the_delay():
    boards = Boards()  # what the batcher reads: requests decoding for its model (index 0)
    async def alone(batcher):
        one = images(1)
        await batcher.submit(one).future
        return one

    async def joined(batcher):
        async def slow_decode():
            with boards.preparing(0):
                await asyncio.sleep(0.02)
            late = images(2)
            await batcher.submit(late).future
            return late

        late = asyncio.create_task(slow_decode())
        await asyncio.sleep(0)  # it is decoding now
        early = images(1)
        await asyncio.gather(batcher.submit(early).future, late)
        return early

    async def abandoned(batcher):
        with boards.preparing(0):  # a decode that never delivers (e.g. a broken image)
            one = images(1)
            await batcher.submit(one).future
            return one

    result, calls = _run_batcher(alone, max_queue_delay_s=0.1, coming=partial(boards.coming, [0]))
    assert calls == [1] and result["queue_ms"][0] < 50  # nothing else coming: no wait
    result, calls = _run_batcher(joined, max_queue_delay_s=0.1, coming=partial(boards.coming, [0]))
    assert calls == [2]
    result, calls = _run_batcher(abandoned, max_queue_delay_s=0.1, coming=partial(boards.coming, [0]))
    assert calls == [1] and 90 <= result["queue_ms"][0] < 1000  # waited for it, but no longer than the delay


def test_batcher_refuses_beyond_its_queue_limit_and_skips_abandoned_requests():
    async def go(batcher):
        with pytest.raises(QueueFull, match="this request's 4 would pass its limit of 3"):
            batcher.submit(images(1, 2, 3, 4))
        abandoned = batcher.submit(images(1, 2)).future
        kept = images(3)
        future = batcher.submit(kept).future
        abandoned.cancel()
        await future
        return kept

    result, calls = _run_batcher(go, queue_limit=3)
    assert calls == [1] and result["logits"][0, 0] == 6


def test_a_request_given_up_while_its_batch_is_gathered_is_left_out_of_it():
    boards = Boards()
    async def go(batcher):
        with boards.preparing(0):  # another request is decoding: the partial batch waits for it, up to 0.1 s
            gone = batcher.submit(images(1, 2)).future
            await asyncio.sleep(0.01)  # now in the batch being gathered, out of the queue
            assert batcher.depth == 0
            gone.cancel()
            await asyncio.sleep(0.15)  # the batch closes with nothing left in it
        await batcher.settled()  # nothing runs for it, so nothing will write into its records
        kept = images(3)
        await batcher.submit(kept).future
        return kept

    result, calls = _run_batcher(go, max_queue_delay_s=0.1, coming=partial(boards.coming, [0]))
    assert calls == [1] and result["logits"][0, 0] == 6  # no batch for the cancelled request, not even an empty one


def test_a_request_whose_client_left_leaves_the_queue_at_once():
    async def main():
        # not started: none taken
        batcher = Batcher("m", lambda parts, queue_ms: 0.0, None, Metrics(), BatchingPolicy(4, 10.0, 8))
        left = batcher.submit(images(*range(6))).future
        with pytest.raises(QueueFull):
            batcher.submit(images(*range(4)))
        left.cancel()  # what a disconnect does to the request's handling
        await asyncio.sleep(0)
        assert batcher.depth == 0
        batcher.submit(images(*range(8)))  # the room is back

    asyncio.run(main())


def test_an_entry_of_scattered_rows_runs_them_alone_and_a_gone_requests_rows_leave_the_queue():
    """A worker's frame: slots of its arena, in any order; a request that goes takes its slots out of the queue."""
    gate = Gate()

    async def go(batcher):
        batcher.submit(images(1, 2, 3, 4))  # a full batch: it runs at once, and holds on until the gate opens
        frame = images(*range(10, 16))
        entry = batcher.submit(frame, rows=np.array([5, 0, 3, 1]))
        try:
            await gate.running()  # the first batch has started: the frame waits behind it, all four of its rows
            assert batcher.depth == 4
            batcher.drop(entry, 3, 4)  # the request in slot 3 has gone: at once, its room is back
            assert batcher.depth == 3
        finally:
            gate.go.set()  # (a failure above must not leave the batch waiting: the batcher's stop awaits it)
        return frame, await entry.future

    (frame, errors), calls = _run_batcher(go, gate)
    assert calls == [4, 3] and errors == {}
    assert frame["logits"][:, 0].tolist() == [20, 22, 0, 0, 0, 30]  # slots 5, 0 and 1; 3 left, 2 and 4 not queued
    assert frame["batch_size"].tolist() == [3, 3, 0, 0, 0, 3]


def test_a_lone_request_runs_in_the_callers_thread_and_never_beside_a_batch():
    boards = Boards()
    async def go(batcher):
        loop = asyncio.get_running_loop()
        alone = images(7)
        with boards.preparing(0):  # as the pipeline calls it: while its own request decodes
            ran = await loop.run_in_executor(None, batcher.try_run_here, alone, 1)
        queued = batcher.submit(images(1, 2))
        with boards.preparing(0):
            busy = await loop.run_in_executor(None, batcher.try_run_here, images(3), 1)  # a batch is on its way
        await queued.future
        with boards.preparing(0), boards.preparing(0):  # another request is decoding: it may join a batch
            waits = await loop.run_in_executor(None, batcher.try_run_here, images(4), 1)
        return ran, alone, busy, waits

    (ran, alone, busy, waits), calls = _run_batcher(go, coming=partial(boards.coming, [0]))
    assert ran and alone["logits"][0, 0] == 14 and alone["batch_size"][0] == 1
    assert not busy and not waits and calls == [1, 2]
    two_at_a_time = Batcher("gpu", lambda parts, queue_ms: 0.0, None, Metrics(), BatchingPolicy(4, 0.0, 8),
                            concurrency=2)
    assert not two_at_a_time.try_run_here(images(5), 1)  # a GPU's batches run in their own threads


def test_a_failed_batch_fails_its_requests_and_the_next_batch_runs():
    async def go(batcher):
        bad = batcher.submit(images(1)).future
        with pytest.raises(ServiceError, match="RuntimeError: kaput") as failed:
            await bad
        assert failed.value.code == "inference_failed"
        good = images(3)
        await batcher.submit(good).future
        return good

    async def main():
        calls = []

        def run(parts, queue_ms):
            calls.append(len(parts))
            if len(calls) == 1:
                raise RuntimeError("kaput")
            parts[0].records["logits"][:, 0] = 1
            return 0.0

        with ThreadPoolExecutor(1) as pool:
            batcher = Batcher("m", run, pool, Metrics(), BatchingPolicy(4, 0.0, 16))
            batcher.start()
            try:
                return await go(batcher)
            finally:
                await batcher.stop()

    assert asyncio.run(main())["logits"][0, 0] == 1


# -- the serving plan --------------------------------------------------------------------------------------------

def fake(name: str, precision: str, providers: list[str]) -> ModelEntry:
    return ModelEntry(Path(name), {"name": name, "precision": precision, "providers": providers})


def test_the_serving_plan_is_decided_once_from_the_device():
    entries = [fake("deit", "fp32", [CUDA, CPU]), fake("deit-fp16", "fp16", [CUDA]), fake("vit-int8", "int8", [CPU])]
    on_gpu = serving_plan(entries, CUDA)
    assert (on_gpu["deit"].graph, on_gpu["deit"].precision, on_gpu["deit"].provider) == ("deit-fp16", "fp16", CUDA)
    assert on_gpu["deit-fp16"].graph == "deit-fp16" and on_gpu["vit-int8"].provider == CPU  # int8 stays on the CPU
    on_cpu = serving_plan(entries, CPU)
    assert (on_cpu["deit"].graph, on_cpu["deit"].precision, on_cpu["deit"].provider) == ("deit", "fp32", CPU)
    assert "CUDA only" in on_cpu["deit-fp16"].error and on_cpu["vit-int8"].error is None


def test_an_fp16_sibling_batches_as_the_fp32_manifest_says_where_its_own_says_nothing(tmp_path, monkeypatch):
    """On CUDA the fp16 sibling's graph serves the fp32 model (serving_plan): a `batching` set in the fp32 manifest,
    the one a user edits, is that graph's, and what the sibling's own manifest sets wins. On the CPU, with the
    device chosen made CUDA's (the sibling, a copy of the fp32 graph, runs there)."""
    from service.core.settings import Settings
    from service.engine.backends import local
    from service_process import write_model
    write_model(tmp_path / "shapes-deit", REPO / "shapes-deit", "shapes-deit",
                batching={"max_batch_size": 4, "queue_limit": 12})
    write_model(tmp_path / "shapes-deit-fp16", REPO / "shapes-deit", "shapes-deit-fp16", precision="fp16",
                batching={"queue_limit": 20})
    monkeypatch.setattr(local, "choose_device", lambda entries, providers: CUDA)

    async def main() -> tuple[str, BatchingPolicy]:
        settings = Settings(model_repository=tmp_path, warmup_runs=0, max_batch_size=16, queue_limit=64)
        backend = local.LocalBackend(settings, Metrics())
        await backend.start()
        await backend.loaded()
        try:
            return backend.models.plans["shapes-deit"].graph, backend.batchers["shapes-deit-fp16"].policy
        finally:
            await backend.close()

    graph, policy = asyncio.run(main())
    assert graph == "shapes-deit-fp16" and (policy.max_batch_size, policy.queue_limit) == (4, 20)


def test_cuda_graphs_come_in_powers_of_two_and_leave_the_cpu_alone():
    assert graph_batches(8) == [1, 2, 4, 8] and graph_batches(6) == [1, 2, 4] and graph_batches(0) == []
    runner = Runner(REPO / "shapes-vit" / "model.onnx", ("images", "pixel_values"), [CPU], cuda_graph_max_batch=8)
    assert runner.graphs == {}
    images = runner.host_batch(3)  # plain memory on the CPU: nothing copies it to a device
    images[:] = 0
    logits = runner.run(images, np.zeros((0, 3, 96, 96), np.float32))["logits"]
    assert logits.shape == (3, 6)


@pytest.mark.parametrize("spin_wait", [True, False])
def test_cpu_sessions_spin_while_a_run_lasts_and_never_between_runs(spin_wait):
    options = open_session(REPO / "shapes-vit" / "model.onnx", [CPU], spin_wait=spin_wait).get_session_options()
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == str(int(spin_wait))
    assert options.get_session_config_entry("session.force_spinning_stop") == "1"


@pytest.mark.parametrize("level", [logging.DEBUG, logging.INFO])
def test_a_sessions_own_warnings_show_at_debug_level(tmp_path, capfd, level):
    """Only ORT's default logger is muted while a session opens (it reports providers that cannot start); the
    session's own warnings, such as CPU-placed nodes on a GPU host, reach the log at --log-level debug (at every
    other level each graph's input defaults would warn at every load)."""
    weight = onnx.numpy_helper.from_array(np.ones(2, np.float32), "w")
    vector = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2]) for n in "xwy"]
    graph = onnx.helper.make_graph([onnx.helper.make_node("Add", ["x", "w"], ["y"])], "g", vector[:2], vector[2:],
                                   [weight])  # an initializer that is also an input: ORT warns that it is no constant
    onnx.save(onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8),
              tmp_path / "m.onnx")
    logger = logging.getLogger("vitserve")
    before = logger.level
    logger.setLevel(level)
    try:
        open_session(tmp_path / "m.onnx", [CPU])
    finally:
        logger.setLevel(before)
    shown = "Initializer w appears in graph inputs" in capfd.readouterr().err
    assert shown == (level == logging.DEBUG)


# -- the attention cache -----------------------------------------------------------------------------------------

def test_attention_cache_is_bounded_by_count_bytes_and_age():
    def record(nbytes: int) -> AttentionResult:
        return AttentionResult("m", {"cls_attention": np.zeros(2, np.float32)}, np.zeros((2, 2, 3), np.uint8),
                               np.zeros(nbytes, np.uint8), (1, 1))

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


# -- what imports what -------------------------------------------------------------------------------------------

def imported_names(folder: Path) -> list[tuple[Path, str]]:
    found = []
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(path, a.name.split(".")[0]) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.append((path, (node.module or "").split(".")[0]))
    return found


def loaded_after(code: str, modules: tuple[str, ...]) -> list[str]:
    check = f"import sys; {code}; print(','.join(m for m in {modules!r} if m in sys.modules))"
    return [m for m in subprocess.run([sys.executable, "-c", check], cwd=ROOT, check=True, capture_output=True,
                                      text=True).stdout.strip().split(",") if m]


WEB = ("fastapi", "starlette", "uvicorn", "service")


def test_service_imports_neither_torch_nor_models_nor_export():
    for path, name in imported_names(ROOT / "service"):
        assert name not in ("torch", "models", "export"), f"{path}: {name}"
    # and at run time, the whole app and its server entry points load without them
    assert loaded_after("import service.http.app, service.__main__, service.ray_serve, service.supervisor",
                        ("torch", "models", "export")) == []


# The service's parts and those each may import (each sub-package's docstring says so): the dependencies point one
# way, from the web edge down to what every part uses
PARTS = {"core": set(), "images": {"core"}, "explain": {"core"}, "engine": {"core", "images", "explain"},
         "pipeline": {"core", "images", "explain", "engine"}, "protocol": {"core", "engine", "pipeline"},
         "http": {"core", "images", "explain", "engine", "pipeline", "protocol"}}
ENTRY_POINTS = ["__init__.py", "__main__.py", "loadtest.py", "ray_serve.py", "supervisor.py"]


def service_imports(path: Path) -> list[str]:
    """The service modules a file imports, by their dotted names (relative imports resolved)."""
    package = list(path.relative_to(ROOT).with_suffix("").parts)[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            found.append(".".join([*base, *([node.module] if node.module else [])]))
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return [name for name in found if name == "service" or name.startswith("service.")]


def test_each_part_of_the_service_imports_only_the_parts_it_may():
    assert sorted(p.name for p in (ROOT / "service").glob("*.py")) == ENTRY_POINTS
    assert sorted(p.name for p in (ROOT / "service").iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        PARTS)
    for part, allowed in PARTS.items():
        assert ast.get_docstring(ast.parse((ROOT / "service" / part / "__init__.py").read_text())), part
        for path in (ROOT / "service" / part).rglob("*.py"):
            for name in service_imports(path):
                assert name.count(".") and name.split(".")[1] in {part, *allowed}, f"{path}: {name}"
    # the load tester is a client: it knows the protocol's messages and nothing of the server
    assert service_imports(ROOT / "service" / "loadtest.py") == ["service.protocol"]


def test_export_and_the_repository_contract_never_load_the_web_stack():
    for folder in ("export", "repository"):
        for path, name in imported_names(ROOT / folder):
            assert name not in WEB, f"{path}: {name}"
    assert loaded_after("import export.pipeline, export.__main__", WEB) == []
    assert loaded_after("import repository", (*WEB, "torch")) == []


def test_a_gzip_bomb_is_inflated_no_further_than_the_body_limit():
    """256 MiB of zeros in 250 kB of gzip, through BodyLimit to an app that reads the whole body: it is given at
    most the limit and one byte, the 413 goes out, and memory never holds the bomb."""
    limit, packer = 2**20, zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    bomb = b"".join(packer.compress(bytes(2**20)) for _ in range(256)) + packer.flush()
    chunks = [bomb[i:i + 65536] for i in range(0, len(bomb), 65536)]
    given, sent = [], []

    async def app(scope, receive, send):
        while (message := await receive())["more_body"]:
            given.append(len(message["body"]))
        await PlainTextResponse("read it all")(scope, receive, send)

    async def receive():
        return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks[1:])} if chunks else {
            "type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v2/models/m/infer",
             "headers": [(b"content-encoding", b"gzip"), (b"content-length", str(len(bomb)).encode())]}
    tracemalloc.start()
    asyncio.run(BodyLimit(app, limit)(scope, receive, send))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert sum(given) <= limit + 1 and peak < 8 * limit, (sum(given), peak)
    assert sent[0]["status"] == 413 and b"decompressed" in sent[1]["body"]


def test_an_answers_writes_in_one_turn_go_out_as_one_and_a_close_or_eof_sends_what_waits_first():
    """uvicorn writes an answer's head, then its body: the transport sends both in one call once the turn ends;
    a close (or an end of file) right after a write sends it before closing."""
    class Transport:
        def __init__(self):
            self.calls, self.closing = [], False

        def writelines(self, pieces):
            self.calls.append(("send", list(pieces)))

        def close(self):
            self.calls.append(("close",))
            self.closing = True

        def write_eof(self):
            self.calls.append(("eof",))

        def is_closing(self):
            return self.closing

        def get_extra_info(self, name):
            return ("127.0.0.1", 8000) if name == "sockname" else None

    async def main():
        inner = Transport()
        combined = WriteCombining(inner, asyncio.get_running_loop())
        combined.write(b"HTTP/1.1 200 OK\r\n\r\n")
        combined.write(b"{}")
        assert inner.calls == [] and combined.get_extra_info("sockname") == ("127.0.0.1", 8000)
        await asyncio.sleep(0)
        assert inner.calls == [("send", [b"HTTP/1.1 200 OK\r\n\r\n", b"{}"])]
        combined.write(b"431")
        combined.write_eof()
        combined.write(b"last")
        combined.close()
        await asyncio.sleep(0)  # the sends scheduled find nothing left, and the transport closed
        return inner.calls[1:]

    assert asyncio.run(main()) == [("send", [b"431"]), ("eof",), ("send", [b"last"]), ("close",)]


def test_a_request_answered_soon_is_never_watched_and_one_that_waits_is_cancelled_once_its_client_leaves():
    """CancelOnDisconnect watches a request from WATCH_AFTER_S after its body is in: one answered sooner never asks
    for another message (no watcher was made), one still waiting then hears of the disconnect and is cancelled,
    and the middleware itself ends normally."""
    messages, cancelled = [], []

    async def receive():
        messages.append(None)
        if len(messages) == 1:
            return {"type": "http.request", "body": b"x", "more_body": False}
        return {"type": "http.disconnect"}

    async def soon(scope, receive, send):
        await receive()
        await asyncio.sleep(0)  # it yields, as sending an answer does: a watcher made at once would run here

    async def waits(scope, receive, send):
        await receive()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def messages_read(app) -> int:
        messages.clear()
        await asyncio.wait_for(CancelOnDisconnect(app)({"type": "http"}, receive, None), 30)
        await asyncio.sleep(2 * CancelOnDisconnect.WATCH_AFTER_S)  # a watcher left behind would read meanwhile
        return len(messages)

    assert asyncio.run(messages_read(soon)) == 1 and not cancelled
    assert asyncio.run(messages_read(waits)) == 2 and cancelled == [True]
