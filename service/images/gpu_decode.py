"""JPEGs decoded and resized on the GPU, in batches, straight into the model's uint8 input on the device.

nvImageCodec decodes a batch of JPEGs into device images (the GPU's JPEG engines first, where it has them); the
images are then resized and centre-cropped by two matrix products whose weights are Pillow's own resampling
coefficients (its filters, widened by the scale when reducing), a batched pair for all the images of one size, so
the model sees what Pillow's resize would give it, give or take the rounding of Pillow's 8-bit intermediate. Each
inference thread decodes with a decoder and a CUDA stream of its own, so one batch decodes while the other runs;
the graphs share those decoders. nvImageCodec fixes a decoder's share for the JPEG engines at its first batch (the
rest goes to CUDA kernels whose Huffman decoding runs on the CPU), so each is warmed with a full batch when it is
made. A batch that fails on the GPU (out of memory, a CUDA error) is decoded on the CPU instead of failing its
requests, and each resize works within a pixel budget.
Optional: it needs a CUDA device, nvImageCodec and CuPy (the gpu extra: `make install RUNTIME=gpu`); where any is
missing or fails to start the service decodes on the CPU, as it does for every image nvImageCodec refuses, and says
why (a warning, and `decode_reason` in /models). The same code runs on the host (`on_host`: nvImageCodec's CPU
decoder, numpy for CuPy), which is how CI runs it. The names used here are those of the locked nvImageCodec 0.9 and
CuPy 14 (a CPU test resolves each one).
"""
import io
import logging
import os
import threading
from collections.abc import Callable
from contextlib import nullcontext
from functools import lru_cache

import numpy as np
from PIL import Image

from repository import InputPolicy
from service.core.thread_names import named

log = logging.getLogger("vitserve")

# Pillow's resampling filters: (support, kernel)
_FILTERS = {
    "bilinear": (1.0, lambda x: np.maximum(0.0, 1.0 - np.abs(x))),
    "bicubic": (2.0, lambda x: _bicubic(np.abs(x))),
    "lanczos": (3.0, lambda x: np.where(np.abs(x) < 3.0, np.sinc(x) * np.sinc(x / 3.0), 0.0)),
}


def _bicubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    return np.where(x < 1.0, ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0,
                    np.where(x < 2.0, (((x - 5.0) * x + 8.0) * x - 4.0) * a, 0.0))


def resample_weights(in_size: int, out_size: int, interpolation: str) -> np.ndarray:
    """[out_size, in_size]: row i holds the weights Pillow gives each input sample for output sample i when it
    resizes one axis (Resample.c's precompute_coeffs, in floating point)."""
    support, kernel = _FILTERS[interpolation]
    scale = in_size / out_size
    filter_scale = max(scale, 1.0)
    support *= filter_scale
    weights = np.zeros((out_size, in_size))
    for i in range(out_size):
        center = (i + 0.5) * scale
        low, high = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), in_size)
        w = kernel((np.arange(low, high) - center + 0.5) / filter_scale)
        weights[i, low:high] = w / w.sum() if w.sum() else w
    return weights


@lru_cache(maxsize=256)
def crop_weights(policy: InputPolicy, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows [H, height], columns [W, width]): resize to the policy's size and crop, for an image of this size."""
    rw, rh = policy.resized(width, height)
    left, top, right, bottom = policy.crop(width, height)
    return (resample_weights(height, rh, policy.interpolation)[top:bottom].astype(np.float32),
            resample_weights(width, rw, policy.interpolation)[left:right].astype(np.float32))


def resize(pixels, rows, columns, xp=np):
    """uint8 [..., h, w, 3] -> uint8 [..., H, W, 3] with the weights of `crop_weights` (numpy or CuPy arrays, as
    `xp`), for one image or a stack of them: across first, rounded to 8 bits, then down, as Pillow does. The
    channels sit beside the columns, so that the first pass is one matrix product over every row of every image."""
    *lead, h, w, _ = pixels.shape
    x = xp.ascontiguousarray(xp.moveaxis(pixels, -1, -2), dtype=xp.float32)  # [..., h, 3, w]
    x = xp.clip(xp.rint(x.reshape(-1, w) @ columns.T), 0, 255)  # [... h 3, W]
    x = rows @ x.reshape(*lead, h, -1)  # [..., H, 3 W]
    x = xp.clip(xp.rint(x), 0, 255).astype(xp.uint8).reshape(*lead, rows.shape[0], 3, columns.shape[0])
    return xp.moveaxis(x, -2, -1)


def is_jpeg(data: bytes) -> bool:
    return data[:3] == b"\xff\xd8\xff"


def is_whole(data: bytes) -> bool:
    """The JPEG ends with its end-of-image marker: nvJPEG "decodes" a cut stream that Pillow refuses, so only
    whole ones go to the GPU (a cut one is the CPU path's to judge)."""
    return data.rstrip(b"\0\r\n ")[-2:] == b"\xff\xd9"


def _refuse(data: bytes) -> np.ndarray:
    raise RuntimeError("not decoded on the GPU")


# CPU threads per decoder (nvImageCodec's default is one per core, per decoder): they parse, and the JPEG engines
# and CUDA kernels do the rest, on a host whose cores the HTTP workers want (nvImageCodec itself allows half the
# cores at most)
DECODER_THREADS = min(4, max(1, (os.cpu_count() or 1) // 2))
# pixels resized at once: the resize works in float32 over 3 channels, 12 bytes a pixel, with a copy or two beside
RESIZE_PIXELS = 16_000_000


def chunks(group: list, pixels: int, budget: int) -> list[list]:
    """One size group split so that each chunk's pixels stay within the budget (at least one image each)."""
    n = max(1, budget // pixels)
    return [group[i:i + n] for i in range(0, len(group), n)]


class GpuDecoder:
    """Batches of JPEG bytes -> uint8 [n, H, W, 3] for one input policy: CuPy arrays on the GPU, or numpy arrays
    `on_host` (nvImageCodec's CPU decoder; for tests)."""

    _threads: dict[int, threading.local] = {}  # the decoders of each thread, by device: shared by the graphs

    def __init__(self, policy: InputPolicy, max_batch: int = 16, device_id: int = 0, on_host: bool = False):
        from nvidia import nvimgcodec

        if policy.interpolation not in _FILTERS:
            raise RuntimeError(f"no GPU resize for {policy.interpolation} interpolation")
        if on_host:
            self.xp, self.device = np, nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY
            self.backends = [nvimgcodec.Backend(nvimgcodec.CPU_ONLY)]
        else:
            import cupy
            self.xp, self.device = cupy, device_id
            # the JPEG engines (A100, H100), then CUDA kernels; nvJPEG's CUDA decoder counts as HYBRID_CPU_GPU.
            # Without CPU_ONLY, what the GPU cannot decode is None, and decoded on the CPU by the service.
            self.backends = [nvimgcodec.Backend(nvimgcodec.HW_GPU_ONLY), nvimgcodec.Backend(nvimgcodec.GPU_ONLY),
                             nvimgcodec.Backend(nvimgcodec.HYBRID_CPU_GPU)]
        self.nvimgcodec, self.policy, self.on_host, self.max_batch = nvimgcodec, policy, on_host, max_batch
        self.params = nvimgcodec.DecodeParams(color_spec=nvimgcodec.ColorSpec.SRGB, apply_exif_orientation=True,
                                              allow_any_depth=False)
        # a Decoder keeps each call's state: one per inference thread
        self.local = self._threads.setdefault(self.device, threading.local())
        self.weights = lru_cache(maxsize=64)(self._weights)  # on the device, by photo size
        probe = io.BytesIO()
        Image.new("RGB", (64, 48), (200, 30, 30)).save(probe, format="JPEG")
        self.probe = probe.getvalue()
        stream = self._stream()  # not decode(): a failure here is the reason GPU decoding does not start
        with stream if stream is not None else nullcontext():
            pixels, errors = self._decode(stream, [self.probe], _refuse)
        if errors or abs(int(pixels[0, 0, 0, 0]) - 200) > 8:
            raise RuntimeError("nvImageCodec did not decode a probe JPEG")

    def _weights(self, width: int, height: int):
        rows, columns = crop_weights(self.policy, width, height)
        rows, columns = self.xp.asarray(rows), self.xp.asarray(columns)
        if not self.on_host:  # copied on this thread's stream; the other inference thread may use them next
            self.xp.cuda.get_current_stream().synchronize()
        return rows, columns

    def _stream(self):
        """This thread's decoder made (self.local.decoder) and its stream: a non-blocking CUDA stream (None on the
        host), so that the two inference threads' decodes, and ONNX Runtime's work, do not wait on each other."""
        if not hasattr(self.local, "decoder"):
            # fancy upsampling: the chroma interpolated as libjpeg-turbo (Pillow) does by default, not repeated
            with named("nvimgcodec"):
                self.local.decoder = self.nvimgcodec.Decoder(device_id=self.device, backends=self.backends,
                                                             max_num_cpu_threads=DECODER_THREADS,
                                                             options=":fancy_upsampling=1")
            self.local.stream = None if self.on_host else self.xp.cuda.Stream(non_blocking=True)
            # its share for the JPEG engines is fixed by its first batch, for good: a full one
            self.local.decoder.decode([self.probe] * self.max_batch, params=self.params,
                                      cuda_stream=self.local.stream.ptr if self.local.stream is not None else 0)
        return self.local.stream

    def decode(self, jpegs: list[bytes],
               fallback: Callable[[bytes], np.ndarray]) -> tuple[object, dict[int, Exception]]:
        """The model inputs [n, H, W, 3], ready for the graph (on the device: the work done); what nvImageCodec
        refuses goes through `fallback` (the CPU path: bytes -> uint8 [H, W, 3]), and what that raises is
        returned by index (those rows are zero)."""
        stream = self._stream()
        try:
            with stream if stream is not None else nullcontext():
                return self._decode(stream, jpegs, fallback)
        except Exception as e:  # noqa: BLE001 - out of memory, a CUDA error: the CPU decodes this batch instead
            log.warning("GPU decoding failed for a batch of %d JPEGs, decoded on the CPU instead: %s: %s",
                        len(jpegs), type(e).__name__, e)
            return self._on_cpu(jpegs, fallback)

    def _on_cpu(self, jpegs: list[bytes], fallback: Callable[[bytes], np.ndarray]):
        out, errors = np.zeros((len(jpegs), *self.policy.size, 3), np.uint8), {}
        for i, data in enumerate(jpegs):
            try:
                out[i] = fallback(data)
            except Exception as e:  # noqa: BLE001 - reported to the request that sent this image
                errors[i] = e
        return self.join(self.xp.zeros((0, *self.policy.size, 3), self.xp.uint8), out), errors

    def _decode(self, stream, jpegs: list[bytes], fallback: Callable[[bytes], np.ndarray]):
        xp = self.xp
        out = xp.zeros((len(jpegs), *self.policy.size, 3), xp.uint8)
        whole = [i for i, data in enumerate(jpegs) if is_whole(data)]
        decoded = self.local.decoder.decode([jpegs[i] for i in whole], params=self.params,
                                            cuda_stream=stream.ptr if stream is not None else 0) if whole else []
        if len(decoded) != len(whole):  # images over nvImageCodec's size limit can drop out of the list
            decoded = [None] * len(whole)
        images = [None] * len(jpegs)
        for i, image in zip(whole, decoded):
            images[i] = image
        by_size, errors = {}, {}
        for i, image in enumerate(images):
            pixels = xp.asarray(image) if image is not None else None
            if pixels is not None and pixels.ndim == 3 and pixels.shape[2] == 3:
                by_size.setdefault(pixels.shape[:2], []).append((i, pixels))
                continue
            try:
                out[i] = xp.asarray(fallback(jpegs[i]))
            except Exception as e:  # noqa: BLE001 - reported to the request that sent this image
                errors[i] = e
        for (height, width), group in by_size.items():  # batched resizes per photo size
            rows, columns = self.weights(width, height)
            for chunk in chunks(group, height * width, RESIZE_PIXELS):
                stacked = xp.stack([pixels for _, pixels in chunk])
                out[[i for i, _ in chunk]] = resize(stacked, rows, columns, xp=xp)
        if stream is not None:
            stream.synchronize()  # ONNX Runtime reads it on a stream of its own
        return out, errors

    def join(self, decoded, host: np.ndarray):
        """The decoded images followed by host ones, ready for the graph."""
        if not len(host):
            return decoded
        joined = self.xp.concatenate([decoded, self.xp.asarray(host)])
        if not self.on_host:
            self.xp.cuda.get_current_stream().synchronize()
        return joined


def gpu_decoder(policy: InputPolicy, model: str, max_batch: int) -> tuple[GpuDecoder | None, str | None]:
    """(a GpuDecoder, None) where CUDA, nvImageCodec and CuPy all work, else (None, why not): the exception's type
    and message, also logged, so that a host serving on CUDA never falls back to the CPU unexplained."""
    try:
        return GpuDecoder(policy, max_batch), None
    except Exception as e:  # noqa: BLE001 - any missing or failing piece means: decode on the CPU
        reason = f"{type(e).__name__}: {e}"
        log.warning("%s: JPEGs are decoded on the CPU, as GPU decoding (nvImageCodec and CuPy, the gpu extra) did "
                    "not start: %s", model, reason)
        return None, reason
