"""JPEGs decoded and resized on the GPU, in batches, straight into the model's uint8 input on the device.

nvImageCodec decodes a batch of JPEGs into device images; each is then resized and centre-cropped by two matrix
products whose weights are Pillow's own resampling coefficients (its filters, widened by the scale when
reducing), so the model sees what the CPU path would give it, give or take the rounding of Pillow's 8-bit
intermediate and its draft-mode JPEG reduction. Optional: it needs a CUDA device, nvImageCodec and CuPy (the
gpu extra: `make install RUNTIME=gpu`); where any is missing or fails to start the service decodes with Pillow,
as it does for every image nvImageCodec refuses, and says why (a warning, and `decode_reason` in /models). The
names used here are those of the locked nvImageCodec 0.9 and CuPy 14 (a CPU test resolves each one).
"""
import io
import logging
import threading
from collections.abc import Callable
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
    """uint8 [h, w, 3] -> uint8 [H, W, 3] with the weights of `crop_weights` (numpy or CuPy arrays, as `xp`):
    across first, rounded to 8 bits, then down, as Pillow does."""
    x = xp.tensordot(columns, pixels.astype(xp.float32), axes=(1, 1))  # [W, h, 3]
    x = xp.clip(xp.rint(x), 0, 255)
    x = xp.tensordot(rows, x, axes=(1, 1))  # [H, W, 3]
    return xp.clip(xp.rint(x), 0, 255).astype(xp.uint8)


def is_jpeg(data: bytes) -> bool:
    return data[:3] == b"\xff\xd8\xff"


def _refuse(data: bytes) -> np.ndarray:
    raise RuntimeError("not decoded on the GPU")


class GpuDecoder:
    """Batches of JPEG bytes -> uint8 [n, H, W, 3] on the GPU (CuPy), for one input policy."""

    def __init__(self, policy: InputPolicy, device_id: int = 0):
        import cupy
        from nvidia import nvimgcodec

        if policy.interpolation not in _FILTERS:
            raise RuntimeError(f"no GPU resize for {policy.interpolation} interpolation")
        self.policy, self.cupy = policy, cupy
        # nvJPEG's CUDA decoder counts as HYBRID_CPU_GPU; without CPU_ONLY, what the GPU cannot decode is None
        backends = [nvimgcodec.Backend(nvimgcodec.GPU_ONLY), nvimgcodec.Backend(nvimgcodec.HYBRID_CPU_GPU)]
        # fancy upsampling: the chroma interpolated as libjpeg-turbo (Pillow) does by default, not repeated
        self.decoder = nvimgcodec.Decoder(device_id=device_id, backends=backends, options=":fancy_upsampling=1")
        self.lock = threading.Lock()  # a Decoder keeps each call's state: the two inference threads take turns
        self.params = nvimgcodec.DecodeParams(color_spec=nvimgcodec.ColorSpec.SRGB, apply_exif_orientation=True,
                                              allow_any_depth=False)
        probe = io.BytesIO()
        Image.new("RGB", (64, 48), (200, 30, 30)).save(probe, format="JPEG")
        pixels, errors = self.decode([probe.getvalue()], _refuse)
        if errors or abs(int(pixels[0, 0, 0, 0]) - 200) > 8:
            raise RuntimeError("nvImageCodec did not decode a probe JPEG on the GPU")

    def _weights(self, width: int, height: int):
        rows, columns = crop_weights(self.policy, width, height)
        return self.cupy.asarray(rows), self.cupy.asarray(columns)

    def decode(self, jpegs: list[bytes],
               fallback: Callable[[bytes], np.ndarray]) -> tuple[object, dict[int, Exception]]:
        """The model inputs [n, H, W, 3] on the device, ready for the graph; what nvImageCodec refuses goes through
        `fallback` (Pillow: bytes -> uint8 [H, W, 3]), and what that raises is returned by index (those rows are
        zero)."""
        cp = self.cupy
        h, w = self.policy.size
        out = cp.zeros((len(jpegs), h, w, 3), cp.uint8)
        with self.lock:
            images = self.decoder.decode(jpegs, params=self.params)
        if len(images) != len(jpegs):  # images over nvImageCodec's size limit can drop out of the list
            images = [None] * len(jpegs)
        errors = {}
        for i, image in enumerate(images):
            pixels = cp.asarray(image) if image is not None else None
            if pixels is not None and pixels.ndim == 3 and pixels.shape[2] == 3:
                out[i] = resize(pixels, *self._weights(pixels.shape[1], pixels.shape[0]), xp=cp)
                continue
            try:
                out[i] = cp.asarray(fallback(jpegs[i]))
            except Exception as e:  # noqa: BLE001 - reported to the request that sent this image
                errors[i] = e
        cp.cuda.get_current_stream().synchronize()  # ONNX Runtime reads it on a stream of its own
        return out, errors

    def join(self, decoded, host: np.ndarray):
        """The decoded images followed by host ones, on the device, ready for the graph."""
        if not len(host):
            return decoded
        joined = self.cupy.concatenate([decoded, self.cupy.asarray(host)])
        self.cupy.cuda.get_current_stream().synchronize()
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
