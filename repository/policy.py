"""How an image becomes the model's input: resize the short side (or to exactly a size, the aspect not kept, as
Hugging Face's ViT and DeiT image processors do), centre-crop, and (in the graph) normalise.

The crop geometry is shared by the service's decoder (which pixels the model sees) and the attention maps
(where those pixels lie in the photo), so both follow one definition.
"""
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class InputPolicy:
    size: tuple[int, int]  # (height, width) of the model input
    resize_short_side: int  # with resize_to, its longer side (the side of /expression's aligned face squares)
    interpolation: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resize_to: tuple[int, int] | None = None  # (height, width): resize to exactly this, the aspect not kept
    # the short-side resize as transformers' processors do it (DINOv2's, CLIP's): the long side truncated, the
    # whole photo at full size through Pillow (model_input), so that the model sees its processor's pixels
    processor_resize: bool = False

    @classmethod
    def from_manifest(cls, section: dict) -> "InputPolicy":
        resize_to = tuple(section["resize_to"]) if "resize_to" in section else None
        return cls(tuple(section["size"]), section["resize_short_side"], section["interpolation"],
                   tuple(section["mean"]), tuple(section["std"]), resize_to, section.get("processor_resize", False))

    @property
    def draft_side(self) -> int | None:
        """The short side a JPEG may decode reduced to (DCT scaling, `decode`'s draft mode); None: at full size, as
        Hugging Face's processors decode, so that their models see the pixels their processor gives."""
        return None if self.resize_to is not None or self.processor_resize else self.resize_short_side

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) after the resize: to resize_to, or the short side to resize_short_side, the aspect kept
        (the long side rounded, or truncated as transformers does with processor_resize)."""
        if self.resize_to is not None:
            return self.resize_to[1], self.resize_to[0]
        short = self.resize_short_side
        if self.processor_resize:  # transformers' get_resize_output_image_size
            return (short, int(short * height / width)) if width <= height else (int(short * width / height), short)
        scale = short / min(width, height)
        return max(short, round(width * scale)), max(short, round(height * scale))

    def crop(self, width: int, height: int) -> tuple[int, int, int, int]:
        """The centre crop (left, top, right, bottom) of the input size, in the resized image's pixels."""
        rw, rh = self.resized(width, height)
        out_h, out_w = self.size
        left, top = (rw - out_w) // 2, (rh - out_h) // 2
        return left, top, left + out_w, top + out_h

    def crop_box(self, width: int, height: int) -> tuple[float, float, float, float]:
        """The part of an image of this size (x0, y0, x1, y1 in its pixels) that the model sees."""
        rw, rh = self.resized(width, height)
        left, top, right, bottom = self.crop(width, height)
        sx, sy = width / rw, height / rh
        return left * sx, top * sy, right * sx, bottom * sy

    def normalise(self, images: np.ndarray) -> np.ndarray:
        """uint8 [B, H, W, 3] -> float32 [B, 3, H, W], (x / 255 - mean) / std: what the graph does to its `images`
        input, and what a client sends as the float `pixel_values` input."""
        x = images.astype(np.float32) / 255.0
        x = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def graph_inputs(x: np.ndarray, names: tuple[str, str] = ("images", "pixel_values")) -> dict[str, np.ndarray]:
    """Both inputs of an exported graph for one batch: uint8 [N, H, W, 3] `x` as the images, float [N, 3, H, W]
    `x` as the normalised pixels, and the other input empty (batch 0), as every run feeds both."""
    images, tensor = names
    if x.dtype == np.uint8:
        return {images: x, tensor: np.zeros((0, 3, *x.shape[1:3]), np.float32)}
    return {images: np.zeros((0, *x.shape[2:], 3), np.uint8), tensor: x}
