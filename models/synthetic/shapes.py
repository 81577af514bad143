"""Shapes: one shape of a known class per image, at a random position, size, rotation and colour, on a
textured background. Each sample carries its shape's bounding box, the ground truth for attention maps.

Backgrounds are light and shapes darker (random hues both): with a random light/dark polarity as well,
small networks need many times more samples to learn colour-invariant edges, which the demo models'
CPU training budget cannot afford.
"""
import numpy as np
from PIL import Image, ImageDraw

from ..labels import SHAPE_LABELS
from . import Sample, sample_rng
from .texture import LUMA, background, finish

LABELS = SHAPE_LABELS
SUPERSAMPLE = 4  # draw the mask at 4x and average down: anti-aliased edges


def _outline(label: str, radius: float, angle: float) -> list[tuple[float, float]] | None:
    """The shape's polygon around (0, 0) inside a circle of `radius`, rotated by `angle`; None for the circle."""
    if label == "circle":
        return None
    if label == "star":
        t = np.arange(10) * np.pi / 5
        pts = np.stack([np.cos(t), np.sin(t)], 1) * np.where(np.arange(10) % 2, 0.45, 1.0)[:, None]
    elif label == "cross":
        a = 0.35  # arm half-width
        pts = np.array([(a, 1), (a, a), (1, a), (1, -a), (a, -a), (a, -1), (-a, -1), (-a, -a), (-1, -a), (-1, a),
                        (-a, a), (-a, 1)])
    elif label == "heart":
        t = np.linspace(0, 2 * np.pi, 48, endpoint=False)
        pts = np.stack([16 * np.sin(t) ** 3,
                        -(13 * np.cos(t) - 5 * np.cos(2 * t) - 2 * np.cos(3 * t) - np.cos(4 * t))], 1)
        pts = (pts - pts.mean(0)) / np.abs(pts).max()
    else:
        corners = {"square": 4, "triangle": 3}[label]
        t = 2 * np.pi * np.arange(corners) / corners
        pts = np.stack([np.cos(t), np.sin(t)], 1)
    rotation = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    return [tuple(p) for p in (pts @ rotation.T) * radius]


def shape_mask(label: str, size: int, centre: tuple[float, float], radius: float, angle: float) -> np.ndarray:
    """[size, size] coverage in [0, 1] of the shape."""
    s = SUPERSAMPLE
    canvas = Image.new("L", (size * s, size * s), 0)
    draw = ImageDraw.Draw(canvas)
    cx, cy = centre[0] * s, centre[1] * s
    outline = _outline(label, radius * s, angle)
    if outline is None:
        draw.ellipse([cx - radius * s, cy - radius * s, cx + radius * s, cy + radius * s], fill=255)
    else:
        draw.polygon([(cx + x, cy + y) for x, y in outline], fill=255)
    return np.asarray(canvas.resize((size, size), Image.BOX), dtype=np.float32) / 255


def _darker_colour(rng: np.random.Generator, against: np.ndarray, min_contrast: float = 0.25) -> np.ndarray:
    """A random colour whose luma is at least `min_contrast` below that of `against` (luma >= 0.55)."""
    while True:
        colour = rng.uniform(0.0, 0.6, 3)
        if (against - colour) @ LUMA >= min_contrast:
            return colour


def render_shape(rng: np.random.Generator, size: int = 96, label: int | None = None,
                 centre: tuple[float, float] | None = None) -> Sample:
    """One sample; `label` and `centre` (pixels) are random unless given."""
    label = int(rng.integers(len(LABELS))) if label is None else label
    radius = rng.uniform(0.15, 0.24) * size
    if centre is None:
        centre = tuple(rng.uniform(radius + 1, size - radius - 1, 2))
    mask = shape_mask(LABELS[label], size, centre, radius, rng.uniform(0, 2 * np.pi))
    image = background(rng, size, low=0.55)
    under = (image * mask[..., None]).sum((0, 1)) / mask.sum()  # the background's colour behind the shape
    colour = _darker_colour(rng, under)
    image = image * (1 - mask[..., None]) + colour * mask[..., None]
    ys, xs = np.nonzero(mask >= 0.5)
    box = (int(xs.min()), int(ys.min()), int(xs.max() - xs.min() + 1), int(ys.max() - ys.min() + 1))
    return Sample(finish(rng, image), label, box, tuple(float(c) for c in colour))


def shapes(seed: int, count: int, size: int = 96) -> list[Sample]:
    """`count` samples, classes balanced (sample i has label i mod 6)."""
    return [render_shape(sample_rng(seed, i), size, label=i % len(LABELS)) for i in range(count)]


def two_shapes(rng: np.random.Generator, size: int = 96, labels: tuple[int, int] | None = None
               ) -> tuple[Image.Image, tuple[int, int], np.ndarray]:
    """Two shapes of two different classes, the first in the left half and the second in the right, for testing
    class-specific maps: (image, their labels, their coverage masks [2, size, size] in [0, 1])."""
    labels = tuple(int(v) for v in rng.choice(len(LABELS), 2, replace=False)) if labels is None else labels
    image = background(rng, size, low=0.55)
    masks = []
    for label, left in zip(labels, (0, size // 2)):
        radius = rng.uniform(0.15, 0.2) * size
        centre = (left + rng.uniform(radius + 1, size // 2 - radius - 1), rng.uniform(radius + 1, size - radius - 1))
        mask = shape_mask(LABELS[label], size, centre, radius, rng.uniform(0, 2 * np.pi))
        under = (image * mask[..., None]).sum((0, 1)) / mask.sum()
        image = image * (1 - mask[..., None]) + _darker_colour(rng, under) * mask[..., None]
        masks.append(mask)
    return finish(rng, image), labels, np.stack(masks)
