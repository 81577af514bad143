"""Image bytes -> model input, following the manifest's policy (the same as models.data.preprocess).

Decoding handles what real uploads contain: EXIF orientation, grayscale, palette and alpha images
(composited on white), CMYK, 16-bit PNG/TIFF. Large JPEGs decode in draft mode, at the smallest power-of-two
reduction that still covers the model's input, which is most of the decoding cost saved.
"""
import io
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import APIError


@dataclass(frozen=True)
class InputPolicy:
    size: tuple[int, int]  # (height, width) of the model input
    resize_short_side: int
    interpolation: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @classmethod
    def from_manifest(cls, section: dict) -> "InputPolicy":
        return cls(tuple(section["size"]), section["resize_short_side"], section["interpolation"],
                   tuple(section["mean"]), tuple(section["std"]))


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16/32-bit grayscale: keep the top 8 bits of 16
        pixels = np.asarray(image, dtype=np.uint32)
        image = Image.fromarray((pixels >> 8 if pixels.max() > 255 else pixels).clip(0, 255).astype(np.uint8))
    elif image.mode == "F":
        image = Image.fromarray(np.asarray(image).clip(0, 255).astype(np.uint8))
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def decode(data: bytes, min_short_side: int | None, max_pixels: int) -> Image.Image:
    """Bytes -> upright RGB image. With `min_short_side`, a JPEG may decode reduced (draft mode) as long as
    its short side stays >= min_short_side; without, at full size."""
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > max_pixels:
            raise APIError(413, "image_too_large",
                           f"image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}")
        if image.format == "JPEG" and min_short_side:
            image.draft("RGB", (min_short_side, min_short_side))
        image = ImageOps.exif_transpose(image)
        return _to_rgb(image)
    except Image.DecompressionBombError as e:
        raise APIError(413, "image_too_large", str(e)) from None
    except UnidentifiedImageError:
        raise APIError(415, "unsupported_media_type",
                       "not an image this server can decode (JPEG, PNG, WebP, GIF, BMP, TIFF)") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise APIError(400, "bad_image", f"the image could not be decoded: {e}") from None


def resize_and_crop(image: Image.Image, policy: InputPolicy) -> Image.Image:
    """Short side to policy.resize_short_side (aspect kept), then the centre crop of the input size."""
    short = policy.resize_short_side
    w, h = image.size
    scale = short / min(w, h)
    image = image.resize((max(short, round(w * scale)), max(short, round(h * scale))),
                         Image.Resampling[policy.interpolation.upper()])
    out_h, out_w = policy.size
    left, top = (image.width - out_w) // 2, (image.height - out_h) // 2
    return image.crop((left, top, left + out_w, top + out_h))


def normalise(image: Image.Image, policy: InputPolicy) -> np.ndarray:
    """RGB image of the input size -> float32 [3, H, W], (x / 255 - mean) / std."""
    x = np.asarray(image, dtype=np.float32) / 255.0
    x = (x - np.asarray(policy.mean, np.float32)) / np.asarray(policy.std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def prepare(data: bytes, policy: InputPolicy, max_pixels: int) -> tuple[np.ndarray, Image.Image]:
    """Bytes -> (model input [3, H, W], the decoded upright image, for overlays)."""
    image = decode(data, policy.resize_short_side, max_pixels)
    return normalise(resize_and_crop(image, policy), policy), image
