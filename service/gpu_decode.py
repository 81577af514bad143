"""JPEGs decoded and resized on the GPU, in batches, straight into the model's uint8 input on the device.

nvImageCodec decodes a batch of JPEGs into device images (the GPU's JPEG engines first, where it has them); the
images are then resized and centre-cropped by two matrix products whose weights are Pillow's own resampling
coefficients (its filters, widened by the scale when reducing), a batched pair for all the images of one size, so
the model sees what Pillow's resize would give it, give or take the rounding of Pillow's 8-bit intermediate. Each
inference thread decodes with a decoder and a CUDA stream of its own, so one batch decodes while the other runs.
Optional: it needs a CUDA device, nvImageCodec and CuPy (the gpu extra: `make install RUNTIME=gpu`); where any is
missing or fails to start the service decodes on the CPU, as it does for every image nvImageCodec refuses, and says
why (a warning, and `decode_reason` in /models). The same code runs on the host (`on_host`: nvImageCodec's CPU
decoder, numpy for CuPy), which is how CI runs it. The names used here are those of the locked nvImageCodec 0.9 and
CuPy 14 (a CPU test resolves each one).
"""
import io
import logging
import threading
from collections.abc import Callable
from contextlib import nullcontext
from functools import lru_cache

import numpy as np
from PIL import Image

from repository import InputPolicy

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


def _refuse(data: bytes) -> np.ndarray:
    raise RuntimeError("not decoded on the GPU")


class GpuDecoder:
    """Batches of JPEG bytes -> uint8 [n, H, W, 3] for one input policy: CuPy arrays on the GPU, or numpy arrays
    `on_host` (nvImageCodec's CPU decoder; for tests)."""

    def __init__(self, policy: InputPolicy, device_id: int = 0, on_host: bool = False):
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
        self.nvimgcodec, self.policy, self.on_host = nvimgcodec, policy, on_host
        self.params = nvimgcodec.DecodeParams(color_spec=nvimgcodec.ColorSpec.SRGB, apply_exif_orientation=True,
                                              allow_any_depth=False)
        self.local = threading.local()  # a Decoder keeps each call's state: one per inference thread
        self.weights = lru_cache(maxsize=64)(self._weights)  # on the device, by photo size
        probe = io.BytesIO()
        Image.new("RGB", (64, 48), (200, 30, 30)).save(probe, format="JPEG")
        pixels, errors = self.decode([probe.getvalue()], _refuse)
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
            self.local.decoder = self.nvimgcodec.Decoder(device_id=self.device, backends=self.backends,
                                                         options=":fancy_upsampling=1")
            self.local.stream = None if self.on_host else self.xp.cuda.Stream(non_blocking=True)
        return self.local.stream

    def decode(self, jpegs: list[bytes],
               fallback: Callable[[bytes], np.ndarray]) -> tuple[object, dict[int, Exception]]:
        """The model inputs [n, H, W, 3], ready for the graph (on the device: the work done); what nvImageCodec
        refuses goes through `fallback` (the CPU path: bytes -> uint8 [H, W, 3]), and what that raises is
        returned by index (those rows are zero)."""
        stream = self._stream()
        with stream if stream is not None else nullcontext():
            return self._decode(stream, jpegs, fallback)

    def _decode(self, stream, jpegs: list[bytes], fallback: Callable[[bytes], np.ndarray]):
        xp = self.xp
        out = xp.zeros((len(jpegs), *self.policy.size, 3), xp.uint8)
        images = self.local.decoder.decode(jpegs, params=self.params,
                                           cuda_stream=stream.ptr if stream is not None else 0)
        if len(images) != len(jpegs):  # images over nvImageCodec's size limit can drop out of the list
            images = [None] * len(jpegs)
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
        for (height, width), group in by_size.items():  # one batched resize per photo size
            rows, columns = self.weights(width, height)
            stacked = xp.stack([pixels for _, pixels in group])
            out[[i for i, _ in group]] = resize(stacked, rows, columns, xp=xp)
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


def gpu_decoder(policy: InputPolicy, model: str) -> tuple[GpuDecoder | None, str | None]:
    """(a GpuDecoder, None) where CUDA, nvImageCodec and CuPy all work, else (None, why not): the exception's type
    and message, also logged, so that a host serving on CUDA never falls back to the CPU unexplained."""
    try:
        return GpuDecoder(policy), None
    except Exception as e:  # noqa: BLE001 - any missing or failing piece means: decode on the CPU
        reason = f"{type(e).__name__}: {e}"
        log.warning("%s: JPEGs are decoded on the CPU, as GPU decoding (nvImageCodec and CuPy, the gpu extra) did "
                    "not start: %s", model, reason)
        return None, reason
