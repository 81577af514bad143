"""Decoding JPEGs with their batch, as the GPU path does, checked on the CPU: the resize weights against Pillow,
and the "jpeg" records' way through the batcher, the backends and the process boundary, with gpu_decode.GpuDecoder
itself run on the host (nvImageCodec's CPU decoder, numpy for CuPy; on the device: tests/test_gpu.py); every name
gpu_decode.py takes from nvImageCodec and CuPy, resolved on the locked versions (the test extra installs them:
they import without a GPU); and a GPU decoder that cannot start, which /models explains."""
import ast
import asyncio
import importlib
import importlib.metadata
import inspect
import io
import logging
import re
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from service_process import (ROOT, awkward_jpegs, direct_probabilities, model_pixels, photo_bytes, run_graph,
                             write_model)
from skimage import data as photos

from repository import InputPolicy, read_entry
from service.images import gpu_decode
from service.http.app import create_app
from service.engine.backends.lifecycle import ModelLifecycle
from service.engine.backends.local import LocalBackend
from service.engine.backends.process import ProcessBackend
from service.engine.backends.inference_process import InferenceServer
from service.images.decode import resize_and_crop, upload_input
from service.core.errors import BadInput, UnsupportedMedia
from service.images.gpu_decode import GpuDecoder, crop_weights, gpu_decoder, is_jpeg, resize
from service.core.metrics import Metrics
from service.pipeline.pipeline import Pipeline
from service.engine.runtime import CUDA
from service.core.settings import Settings

REPO = ROOT / "model_repository"


@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear", "lanczos"])
@pytest.mark.parametrize("size,short,resize_to", [((96, 96), 96, None), ((224, 224), 248, None),
                                                  ((112, 112), 128, None),  # and Hugging Face's exact resizes:
                                                  ((224, 224), 224, (224, 224)), ((224, 224), 288, (256, 288))])
def test_the_matrix_resize_is_pillows_within_one_level(interpolation, size, short, resize_to):
    policy = InputPolicy(size, short, interpolation, (0.5,) * 3, (0.5,) * 3, resize_to)
    for name in ("chelsea", "astronaut", "coffee", "rocket"):
        image = Image.fromarray(getattr(photos, name)()).convert("RGB")
        want = np.asarray(resize_and_crop(image, policy)).astype(int)
        got = resize(np.asarray(image), *crop_weights(policy, *image.size)).astype(int)
        assert got.shape == (*size, 3) and np.abs(got - want).max() <= 1, name
        # off by one only where Pillow's fixed-point rounding ties (and, for a squash then a crop, where the crop's
        # region resized alone, Pillow's here, rounds its edges otherwise than the whole resize the matrix crops)
        assert np.abs(got - want).mean() < (0.1 if resize_to and resize_to != size else 0.05)
        # a batch of one size, in one pair of products: each image as alone, give or take float sums' order
        flipped = np.asarray(image)[::-1]
        stacked = resize(np.stack([np.asarray(image), flipped]), *crop_weights(policy, *image.size)).astype(int)
        alone = resize(flipped, *crop_weights(policy, *image.size)).astype(int)
        assert np.abs(stacked[0] - got).max() <= 1 and np.abs(stacked[1] - alone).max() <= 1
        assert (stacked[0] != got).mean() < 1e-3 and (stacked[1] != alone).mean() < 1e-3


class CountingDecoder(GpuDecoder):
    """The GPU decoder as it runs on the host (nvImageCodec's CPU decoder, numpy for CuPy), counting its batches."""

    def __init__(self, policy: InputPolicy):
        super().__init__(policy, on_host=True)
        self.calls = []

    def decode(self, jpegs, fallback):
        if hasattr(self, "calls"):  # not the start-up probe
            self.calls.append(len(jpegs))
        return super().decode(jpegs, fallback)


def test_a_batch_is_resized_once_per_photo_size_in_its_order_and_a_bad_jpeg_fails_alone(monkeypatch):
    policy = InputPolicy((96, 96), 110, "bicubic", (0.5,) * 3, (0.5,) * 3)
    decoder = GpuDecoder(policy, on_host=True)
    resizes = []
    monkeypatch.setattr(gpu_decode, "resize", lambda pixels, *a, **kw: resizes.append(len(pixels)) or
                        resize(pixels, *a, **kw))
    chelsea, coffee = photos.chelsea(), photos.coffee()
    batch = [chelsea, coffee, chelsea[::-1], None, photos.rocket(), coffee[:, ::-1]]  # two sizes twice
    jpegs = [b"\xff\xd8\xff not a JPEG" if x is None else encode_jpeg(x) for x in batch]
    out, errors = decoder.decode(jpegs, lambda data: upload_input(data, policy, 10**8))
    assert sorted(resizes) == [1, 2, 2]  # three photo sizes, each in one pair of products
    assert list(errors) == [3] and isinstance(errors[3], UnsupportedMedia) and not out[3].any()
    for i, photo in enumerate(batch):
        if photo is not None:  # each row is its own photo's, as resized alone
            pixels = np.asarray(Image.open(io.BytesIO(jpegs[i])).convert("RGB"))
            alone = resize(pixels, *crop_weights(policy, pixels.shape[1], pixels.shape[0])).astype(int)
            assert np.abs(out[i].astype(int) - alone).max() <= 1, i


def test_awkward_jpegs_give_the_cpu_paths_pixels_and_a_truncated_one_is_the_cpu_paths_to_refuse():
    """Progressive, grayscale, CMYK and EXIF-rotated JPEGs in one batch come out as the CPU path makes them; a cut
    one never reaches nvImageCodec (nvJPEG would "decode" it) and fails as the CPU path fails it."""
    policy = read_entry(REPO / "shapes-vit").policy
    jpegs = awkward_jpegs()
    sent = []

    def cpu(data: bytes) -> np.ndarray:
        sent.append(data)
        return upload_input(data, policy, 10**8)

    out, errors = GpuDecoder(policy, on_host=True).decode(list(jpegs.values()), cpu)
    assert list(errors) == [5] and isinstance(errors[5], BadInput) and "truncated" in errors[5].message
    assert jpegs["truncated"] in sent
    for i, (name, data) in enumerate(jpegs.items()):
        if name != "truncated":  # full-size decode + matrix resize against the reduced decode and OpenCV's warp:
            # 2-7 levels apart on average; a quarter turn wrong is over 30
            assert np.abs(out[i].astype(int) - model_pixels(REPO / "shapes-vit", data)).mean() < 10, name


def test_a_batch_that_fails_on_the_gpu_is_decoded_on_the_cpu_and_large_ones_resize_within_a_pixel_budget(
        monkeypatch, caplog):
    policy = read_entry(REPO / "shapes-vit").policy
    decoder = GpuDecoder(policy, on_host=True)
    jpegs = [photo_bytes("chelsea", "JPEG", quality=90)] * 3 + [b"\xff\xd8\xff not a JPEG"]
    want = upload_input(jpegs[0], policy, 10**8)
    resizes = []
    monkeypatch.setattr(gpu_decode, "RESIZE_PIXELS", 2 * 451 * 300)  # two chelseas at a time
    monkeypatch.setattr(gpu_decode, "resize", lambda pixels, *a, **kw: resizes.append(len(pixels)) or
                        resize(pixels, *a, **kw))
    out, errors = decoder.decode(jpegs, lambda data: upload_input(data, policy, 10**8))
    assert resizes == [2, 1] and list(errors) == [3]

    def out_of_memory(*args):
        raise MemoryError("out of memory allocating 12,000,000,000 bytes")

    monkeypatch.setattr(decoder, "_decode", out_of_memory)
    with caplog.at_level(logging.WARNING, "vitserve"):
        out, errors = decoder.decode(jpegs, lambda data: upload_input(data, policy, 10**8))
    assert list(errors) == [3] and isinstance(errors[3], UnsupportedMedia)
    assert all((out[i] == want).all() for i in range(3)) and "decoded on the CPU instead" in caplog.text


def test_the_graphs_share_each_threads_decoder_and_it_first_decodes_a_full_batch(monkeypatch):
    """nvImageCodec fixes a decoder's share for the JPEG engines at its first batch: a decoder made by the start-up
    probe on one inference thread, or by a first batch of one on the other, would keep a one-image share."""
    nvimgcodec = importlib.import_module("nvidia.nvimgcodec")
    made, real = [], nvimgcodec.Decoder

    class Recording:
        def __init__(self, **kwargs):
            self.decoder, self.batches = real(**kwargs), []
            made.append(self)

        def decode(self, jpegs, **kwargs):
            self.batches.append(len(jpegs))
            return self.decoder.decode(jpegs, **kwargs)

    monkeypatch.setattr(nvimgcodec, "Decoder", Recording)
    monkeypatch.setattr(GpuDecoder, "_threads", {})
    vit, deit = (read_entry(REPO / name).policy for name in ("shapes-vit", "shapes-deit"))
    one, two = GpuDecoder(vit, max_batch=8, on_host=True), GpuDecoder(deit, max_batch=8, on_host=True)
    # one decoder for both graphs on this thread: its warm-up, then each one's start-up probe
    assert one.local is two.local and len(made) == 1 and made[0].batches == [8, 1, 1]
    jpeg = [photo_bytes("chelsea", "JPEG")]
    with ThreadPoolExecutor(1) as other:
        other.submit(two.decode, jpeg, lambda data: None).result()
    assert len(made) == 2 and made[1].batches == [8, 1]


FREED_WHILE_DECODING = """
import faulthandler, sys, threading
from pathlib import Path
sys.path.insert(0, "tests")
from service_process import photo_bytes
from repository import read_entry
from service.images.decode import upload_input
from service.images.gpu_decode import GpuDecoder
from nvidia import nvimgcodec
faulthandler.enable()
freed, Decoder = [0], nvimgcodec.Decoder


class Counted:  # nvImageCodec's decoder, its end counted
    def __init__(self, **kwargs):
        self.decoder = Decoder(**kwargs)

    def decode(self, *args, **kwargs):
        return self.decoder.decode(*args, **kwargs)

    def __del__(self):
        freed[0] += 1


nvimgcodec.Decoder = Counted
try:
    import cupy
    gpu = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:
    gpu = False
policy = read_entry(Path("model_repository/shapes-vit")).policy
decoder = GpuDecoder(policy, max_batch=8, on_host=not gpu)
jpegs, stop, decoded, failed = [photo_bytes("chelsea", "JPEG")] * 8, threading.Event(), [0], []


def cpu(data):
    return upload_input(data, policy, 10**8)


def steady():
    try:
        while not stop.is_set():
            failed.extend(decoder.decode(jpegs, cpu)[1].values())
            decoded[0] += 1
    except Exception as e:
        failed.append(e)


def brief():
    failed.extend(decoder.decode(jpegs[:1], cpu)[1].values())


steadily = threading.Thread(target=steady)
steadily.start()
for _ in range(6):
    thread = threading.Thread(target=brief)
    thread.start()
    thread.join()
ended = freed[0]
stop.set()
steadily.join()
print("gpu" if gpu else "host", ended, decoded[0] > 0, failed)
"""


def test_a_thread_that_ends_frees_its_decoder_while_another_thread_decodes():
    """A thread's decoder is its own, and freed as the thread ends (a model's inference threads, stopped), while
    other threads' decoders decode. The engines bench crashed on an H200 where, it seems, one thread's decoder was
    freed while another decoded (bench/results/gpu-2026-12-04-ccf02bb-engines.txt); the service must not. On the
    GPU where CuPy sees one (so in the GPU check), else on nvImageCodec's CPU decoder; in a process of its own, so
    that a crash is this test's failure and names its stacks."""
    done = subprocess.run([sys.executable, "-c", FREED_WHILE_DECODING], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split()[1:] == ["6", "True", "[]"], done.stdout  # 6 decoders freed, decoding went on


def encode_jpeg(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def assert_close_logits(got: np.ndarray, want: np.ndarray) -> None:
    """Two decode paths' logits of one photo: the same best label, each logit within 10% of the row's spread (the
    multi-label shapes-vit's logits spread over about 13 on the cat photo; its two decodes differ by up to 0.86)."""
    got, want = np.atleast_2d(got), np.atleast_2d(want)
    assert (got.argmax(1) == want.argmax(1)).all()
    spread = want.max(1, keepdims=True) - want.min(1, keepdims=True)
    assert (np.abs(got - want) <= 0.1 * spread).all(), (got, want)


def settings(**kw) -> Settings:
    # the decoder is given to one model by hand (a GPU host would give one to every model)
    return Settings(model_repository=REPO, warmup_runs=0, gpu_decode=False, **kw)


def test_jpegs_decoded_with_their_batch_give_the_cpu_paths_answers_and_a_bad_one_fails_alone():
    jpegs = [photo_bytes(name, "JPEG", quality=90) for name in ("chelsea", "coffee", "rocket")]
    assert all(map(is_jpeg, jpegs)) and not is_jpeg(photo_bytes("chelsea", "PNG"))
    pixels = np.stack([model_pixels(REPO / "shapes-vit", j) for j in jpegs])
    want = run_graph(REPO / "shapes-vit" / "model.onnx", pixels)

    async def main():
        # a delay no decode here outlasts: the batch closes as soon as no request is decoding for it any more
        # (Batcher._gather), so with the PNG in it, however long its decode on the CPU takes
        backend = LocalBackend(settings(max_queue_delay_ms=60_000), Metrics())
        await backend.start()
        await backend.loaded()
        vit = next(e for e in backend.entries if e.name == "shapes-vit")
        decoder = CountingDecoder(vit.policy)
        backend.models.use_jpeg_decoder("shapes-vit", decoder)
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
    # full-size decode + Pillow's resize on the "GPU" vs Pillow's draft-mode decode and OpenCV's warp: close
    assert_close_logits(good.fields["logits"], want[0])


class HeldDecoder(CountingDecoder):
    """A GPU decoder that decodes nothing until `go` is set: its queue grows meanwhile. `entered`: batches waiting."""

    def __init__(self, policy: InputPolicy):
        super().__init__(policy)
        self.entered, self.go = 0, threading.Event()

    def decode(self, jpegs, fallback):
        if hasattr(self, "go"):  # not the start-up probe
            self.entered += 1
            assert self.go.wait(60), "the test never let the decoder go"
        return super().decode(jpegs, fallback)


async def until(condition, what: str, timeout_s: float = 60) -> None:
    """Until `condition()` holds, a few turns of this event loop away (a liveness bound, not a measurement)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.005)


def test_the_gpu_takes_jpegs_while_its_queue_has_room_and_the_cpu_decodes_the_rest():
    """The decode router: room for 1 batch of 2 JPEGs per inference thread (one thread on the CPU, two on CUDA).
    A first JPEG per thread runs (its decode held), the room's worth queue for the decoder one by one, and the next,
    with the queue full, is decoded on the CPU and queued as an image. Once the decoder moves, all are answered as
    the CPU path answers them, and /metrics counts every upload but the last decoded on the GPU."""
    jpeg = photo_bytes("chelsea", "JPEG", quality=90)
    want = run_graph(REPO / "shapes-vit" / "model.onnx", model_pixels(REPO / "shapes-vit", jpeg)[None])[0][0]

    async def main():
        backend = LocalBackend(settings(max_batch_size=2, gpu_decode_queue_batches=1, max_queue_delay_ms=0),
                               Metrics())
        await backend.start()
        await backend.loaded()
        threads = backend.concurrency
        vit = next(e for e in backend.entries if e.name == "shapes-vit")
        decoder = HeldDecoder(vit.policy)
        backend.models.use_jpeg_decoder("shapes-vit", decoder)
        metrics = Metrics()
        answers = []
        try:
            with ThreadPoolExecutor(2) as pool:
                pipeline = Pipeline(vit, backend, pool, backend.settings, metrics)
                for held in range(1, threads + 1):  # one at a time: two queued in one turn would be one batch
                    answers.append(asyncio.create_task(pipeline.images([jpeg])))
                    await until(lambda: decoder.entered == held, f"{held} held batches, one per inference thread")
                rooms = []
                for depth in range(1, 2 * threads + 2):  # each queued before the next comes
                    rooms.append(backend.gpu_room("shapes-vit"))
                    answers.append(asyncio.create_task(pipeline.images([jpeg])))
                    await until(lambda: backend.batchers["shapes-vit"].depth >= depth, f"{depth} queued")
                    # the batcher tells the board its room once the turn that queued it is over
                    # (Batcher._tell_depth): read it after that turn (failed by chance without: [2, 2, 0])
                    await asyncio.sleep(0)
                decoder.go.set()
                done = await asyncio.gather(*answers)
        finally:
            decoder.go.set()
            await backend.close()
        decoded = {where: metrics.registry.get_sample_value("vitserve_images_decoded_total",
                                                            {"model": "shapes-vit", "where": where})
                   for where in ("gpu", "cpu")}
        return threads, rooms, decoder.calls, done, decoded

    threads, rooms, calls, done, decoded = asyncio.run(main())
    assert rooms == list(range(2 * threads, -1, -1)) and decoded == {"gpu": 3 * threads, "cpu": 1}
    assert calls[:threads] == [1] * threads and sorted(calls[threads:]) == [2] * threads
    for out in done:
        assert_close_logits(out.fields["logits"][0], want)


def test_jpeg_bytes_cross_to_the_inference_process_beside_their_records(tmp_path):
    """Two requests in one frame, one with a JPEG no decoder reads: that one fails alone."""
    jpeg = photo_bytes("chelsea", "JPEG", quality=90)

    async def run(worker: ProcessBackend, jpegs: list[bytes]) -> np.ndarray:
        with worker.records("shapes-deit", "jpeg", len(jpegs)) as lease:
            assert "image" not in lease.records.dtype.names
            await worker.run("shapes-deit", lease, 2, jpegs)
            return lease.records["logits"].copy()

    async def main():
        stop = asyncio.Event()
        server = InferenceServer(settings(), tmp_path / "inference.sock")
        serving = asyncio.create_task(server.serve(stop))
        worker = ProcessBackend(settings(), tmp_path / "inference.sock")
        try:
            await worker.start()
            await worker.loaded()
            decoder = CountingDecoder(next(e for e in server.backend.entries if e.name == "shapes-deit").policy)
            server.backend.models.use_jpeg_decoder("shapes-deit", decoder)  # pushed to the worker as status
            for _ in range(100):
                if worker.status()["shapes-deit"].decode == "gpu":
                    break
                await asyncio.sleep(0.01)
            else:
                pytest.fail("the decoder's status never reached the worker")
            # the decode router's reading, from the inference process's shared memory: 2 batches of 16 per inference
            # thread (one on the CPU, two on CUDA)
            assert worker.gpu_room("shapes-deit") == 2 * 16 * server.backend.concurrency
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


# -- the names gpu_decode.py uses, on the locked nvImageCodec and CuPy ----------------------------------------
GPU_PACKAGES = ("nvidia", "cupy", "cupyx")  # nvidia.nvimgcodec (its `nvjpeg` extra: nvidia-nvjpeg), CuPy


def dotted(node: ast.AST) -> str | None:
    """`a.b.c` for an attribute chain on a name; None for one on a call's result or a literal."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def resolve(name: str, known: dict[str, object]) -> tuple[str, object] | None:
    """(the part that is missing, or "", the object) for a chain that starts at a known name; None for others."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if (root := ".".join(parts[:i])) in known:
            obj = known[root]
            for part in parts[i:]:
                if not hasattr(obj, part):
                    return part, obj
                obj = getattr(obj, part)
            return "", obj
    return None


def accepts(function: object, keyword: str) -> bool:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # pybind11 (nvImageCodec): the signatures are in the docstrings
        doc = (function.__init__ if isinstance(function, type) else function).__doc__ or ""
        return re.search(rf"\b{keyword}: ", doc) is not None
    return keyword in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def test_every_nvimgcodec_and_cupy_name_gpu_decode_uses_exists_in_the_locked_versions():
    """gpu_decode.py's modules, the names bound to them or to instances of their classes, each attribute chain on
    those and each keyword passed to their functions, resolved on the installed packages: a Decoder needs a GPU to
    be built, their names do not. A missing package fails here (CI installs the test extra), never skips."""
    pins = dict(line.split("==") for line in (ROOT / "requirements.lock").read_text().splitlines() if "==" in line)
    for package in ("nvidia-nvimgcodec-cu13", "nvidia-nvjpeg", "cupy-cuda13x"):  # the versions checked: the lock's
        assert importlib.metadata.version(package) == pins[package], package
    tree = ast.parse(Path(gpu_decode.__file__).read_text())
    known: dict[str, object] = {"xp": importlib.import_module("cupy")}  # resize()'s array module: CuPy on the GPU
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                module = f"{node.module}.{alias.name}" if isinstance(node, ast.ImportFrom) else alias.name
                if module.split(".")[0] in GPU_PACKAGES:  # ModuleNotFoundError: not installed, fails the test
                    known[alias.asname or alias.name] = importlib.import_module(module)
    assert {"cupy", "nvimgcodec"} <= set(known)
    # in source order, names bound to a module (`cp = self.cupy`) or to an instance of its class (a Decoder)
    for node in sorted((n for n in ast.walk(tree) if isinstance(n, ast.Assign)), key=lambda n: n.lineno):
        targets, values = node.targets[0], node.value
        pairs = zip(targets.elts, values.elts) if isinstance(targets, ast.Tuple) and isinstance(values, ast.Tuple) \
            else [(targets, values)]
        for target, value in pairs:
            made = isinstance(value, ast.Call)
            found = (name := dotted(value.func if made else value)) and resolve(name, known)
            if found and not found[0] and (not made or isinstance(found[1], type)) and (key := dotted(target)):
                known[key] = found[1]
    checked, missing = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (name := dotted(node)) and (found := resolve(name, known)):
            checked.add(name)
            if found[0]:
                missing.append(f"line {node.lineno}: {name} ({found[1]!r} has no {found[0]})")
        if isinstance(node, ast.Call) and (name := dotted(node.func)) and (found := resolve(name, known)):
            missing += [f"line {node.lineno}: {name}({k.arg}=...)" for k in node.keywords
                        if not found[0] and k.arg and not accepts(found[1], k.arg)]
    assert not missing, missing
    # the names that broke on nvImageCodec 0.9 and those the decode runs through were checked, not passed over
    assert {"nvimgcodec.ColorSpec.SRGB", "nvimgcodec.HW_GPU_ONLY", "self.nvimgcodec.Decoder",
            "self.local.decoder.decode", "self.xp.cuda.Stream", "xp.zeros", "xp.ascontiguousarray"} <= checked, \
        sorted(checked)


def test_the_engine_experiments_build_and_measure_every_configuration_they_name():
    """bench/jpeg_engines.py --quick: every experiment's configurations (the batched paths' options, load hints and
    their policies, output reuse, the memory pool's threshold where a GPU has one) built by the installed nvImageCodec
    and measured, one line each; without a GPU its CPU decoder stands in for the engines. None refused."""
    out = subprocess.run([sys.executable, "bench/jpeg_engines.py", "--quick"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    measured = re.findall(r"^(E\d) [^:]+: .* img/s, [\d.]+ CPU ms/img$", out.stdout, re.M)
    # E1's grid cut to 3 of 12 by --quick, E2 2, E3 5, E5 2 configurations, each on 3 image sets; E4 6 on one
    assert [measured.count(e) for e in ("E1", "E2", "E3", "E4", "E5")] == [9, 6, 15, 6, 6], out.stdout
    assert "FAILED" not in out.stdout and re.search(r"^E0: ", out.stdout, re.M), out.stdout
    assert re.search(r"^E3 best: ", out.stdout, re.M), out.stdout


def test_without_a_gpu_the_locked_decoder_fails_to_start_for_that_alone_and_says_why(caplog):
    """Here nvImageCodec and CuPy import and only the GPU is missing: nvImageCodec's Decoder refuses to start
    (a RuntimeError: no libcuda), not an ImportError or a name the installed version lacks, and it is logged."""
    cupy = importlib.import_module("cupy")
    try:
        gpus = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        gpus = 0
    if gpus:
        pytest.skip("this host has a GPU: tests/test_gpu.py builds the decoder")
    policy = InputPolicy((96, 96), 96, "bicubic", (0.5,) * 3, (0.5,) * 3)
    with caplog.at_level(logging.WARNING, "vitserve"):
        decoder, reason = gpu_decoder(policy, "shapes-vit", 16)
    assert decoder is None and reason.startswith("RuntimeError: "), reason
    assert any(r.levelno == logging.WARNING and "shapes-vit" in r.getMessage() and reason in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_where_cuda_serves_and_gpu_decoding_does_not_start_models_says_why(backend, monkeypatch, caplog, tmp_path):
    """The graphs run on the CPU reported as CUDA, so the backend tries to build their GPU decoders, and
    nvImageCodec's Decoder fails as it does without a GPU: the models decode on the CPU, /models says why (under
    the process backend too, from the inference process), and a warning said it at start-up. Models on the CPU,
    or with VITSERVE_GPU_DECODE off, have no reason."""
    nvimgcodec = importlib.import_module("nvidia.nvimgcodec")

    def no_gpu(*args, **kwargs):
        raise RuntimeError("CUDA Runtime failure: '#35'")  # cudaErrorInsufficientDriver

    opened = ModelLifecycle._open

    def on_cuda(self, entry, plan, *serving):
        runner, chosen = opened(self, entry, plan, *serving)
        runner.provider = CUDA if entry.name != "shapes-vit-int8" else runner.provider  # int8 runs on the CPU
        return runner, chosen

    monkeypatch.setattr(nvimgcodec, "Decoder", no_gpu)
    monkeypatch.setattr(ModelLifecycle, "_open", on_cuda)

    async def models(gpu_decode: bool) -> dict[str, dict]:
        settings = Settings(model_repository=REPO, warmup_runs=0, gpu_decode=gpu_decode)
        async with served(settings, backend, tmp_path / f"{gpu_decode}.sock") as client:
            return {m["name"]: m for m in (await client.get("/models")).json()["models"]}

    with caplog.at_level(logging.WARNING, "vitserve"):
        on = asyncio.run(models(True))
    reason = "RuntimeError: CUDA Runtime failure: '#35'"
    assert on["shapes-vit"]["provider"] == CUDA and on["shapes-vit"]["decode"] == "cpu"
    assert on["shapes-vit"]["decode_reason"] == on["shapes-deit"]["decode_reason"] == reason
    assert on["shapes-vit-int8"]["decode"] == "cpu" and on["shapes-vit-int8"]["decode_reason"] is None
    assert any(r.levelno == logging.WARNING and r.getMessage().startswith("shapes-vit:") and reason in r.getMessage()
               for r in caplog.records)
    off = asyncio.run(models(False))
    assert all(m["decode"] == "cpu" and m["decode_reason"] is None for m in off.values())


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_a_graph_loaded_after_start_up_decodes_on_the_cpu_and_models_says_why(backend, monkeypatch, tmp_path):
    """Only start-up sets up GPU decoders (docs/serving.md): with GPU decoding on and the models on CUDA, a graph
    loaded later (POST /v2/repository/models/NAME/load) decodes its JPEGs on the CPU, and /models says so, while
    the start-up graph goes on decoding with its decoder. As above, the graphs run on the CPU reported as CUDA;
    the start-up decoder is gpu_decode.GpuDecoder on the host (nvImageCodec's CPU decoder), as the tests above run
    it. On a GPU host, tests/test_gpu.py runs the same on a real server with the real decoder."""
    opened, decoders = ModelLifecycle._open, {}

    def on_cuda(self, entry, plan, *serving):
        runner, chosen = opened(self, entry, plan, *serving)
        runner.provider = CUDA
        return runner, chosen

    def on_the_host(policy, model, max_batch):  # what lifecycle's start-up calls, here without a GPU to build on
        decoders[model] = CountingDecoder(policy)
        return decoders[model], None

    monkeypatch.setattr(ModelLifecycle, "_open", on_cuda)
    monkeypatch.setattr(gpu_decode, "gpu_decoder", on_the_host)
    repository = tmp_path / "repository"
    write_model(repository / "shapes-vit", REPO / "shapes-vit", "shapes-vit")
    jpeg = photo_bytes("chelsea", "JPEG", quality=90)

    async def main() -> tuple[dict, dict, httpx.Response, httpx.Response]:
        settings = Settings(model_repository=repository, warmup_runs=0, gpu_decode=True, model_control="explicit")
        async with served(settings, backend, tmp_path / "inference.sock") as client:
            async def models() -> dict[str, dict]:
                return {m["name"]: m for m in (await client.get("/models")).json()["models"]}

            async def classify(model: str) -> httpx.Response:
                return await client.post("/classify", files={"file": ("chelsea.jpg", jpeg)},
                                         params={"model": model, "top_k": 6})

            at_start = await models()
            write_model(repository / "shapes-deit", REPO / "shapes-deit", "shapes-deit")
            loaded = await client.post("/v2/repository/models/shapes-deit/load")
            assert loaded.status_code == 200, loaded.text
            for _ in range(100):  # under the process backend the status reaches the worker as a push
                if "shapes-deit" in (later := await models()):
                    break
                await asyncio.sleep(0.01)
            return at_start, later, await classify("shapes-deit"), await classify("shapes-vit")

    at_start, later, deit, vit = asyncio.run(main())
    assert at_start["shapes-vit"]["provider"] == CUDA and at_start["shapes-vit"]["decode"] == "gpu"
    assert at_start["shapes-vit"]["decode_reason"] is None and "shapes-deit" not in at_start
    assert later["shapes-deit"]["provider"] == CUDA and later["shapes-deit"]["ready"]
    assert later["shapes-deit"]["decode"] == "cpu"
    assert later["shapes-deit"]["decode_reason"] == ("GPU decoding is set up at start-up only, and this graph was "
                                                    "loaded later")
    assert (later["shapes-vit"]["decode"], later["shapes-vit"]["decode_reason"]) == ("gpu", None)
    # the start-up graph's JPEG went to its decoder, one batch; no decoder was made for the late graph, whose
    # JPEG gave the CPU path's answers within the export gate's 1e-4: on a GPU host the graph runs on CUDA in fp32
    # (test_gpu.py's bound for the same); a full-size decode and resize on the "GPU" would move them by tenths
    assert deit.status_code == 200 and vit.status_code == 200, (deit.text, vit.text)
    assert list(decoders) == ["shapes-vit"] and decoders["shapes-vit"].calls == [1]
    got = {p["index"]: p["score"] for p in deit.json()["results"][0]["predictions"]}
    np.testing.assert_allclose([got[i] for i in range(6)], direct_probabilities(REPO / "shapes-deit", jpeg),
                               atol=1e-4)


@asynccontextmanager
async def served(settings: Settings, backend: str, socket: Path) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app over the backend, its models loaded; under "process" the inference process's server in
    this process, on `socket`, and the app as its one worker."""
    stop = asyncio.Event()
    if backend == "process":
        serving = asyncio.create_task(InferenceServer(settings, socket).serve(stop))
    app = create_app(settings, ProcessBackend(settings, socket) if backend == "process"
                     else LocalBackend(settings, Metrics()), metrics=Metrics())
    try:
        async with app.router.lifespan_context(app):
            await app.state.pipelines.backend.loaded()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://v") as client:
                yield client
    finally:
        if backend == "process":
            stop.set()
            await serving
