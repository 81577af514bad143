"""Cartoon faces showing RAF-DB's seven basic expressions, drawn from brows, eyes, nose and mouth.

Each expression is a target pose of the features (brow height and slant, eye opening, mouth shape);
a sample moves from neutral towards it by a random intensity, and varies face size, shape, skin and ink
colour, hair, line width, background and noise. Like RAF-DB's aligned 112 x 112 crops, the face is
centred and fills the frame, with a little jitter in position, size and roll. The box is the face's
bounding box.

Feature coordinates are in face half-widths from the face centre, y pointing down.
"""
import math

import numpy as np
from PIL import Image, ImageDraw

from ..labels import RAF_DB_LABELS
from . import Sample, sample_rng
from .texture import background, finish, random_colour

LABELS = RAF_DB_LABELS
SUPERSAMPLE = 4

# Brows as (inner height, outer height, arch); eyes as (opening, kind); then the mouth's kind.
# Heights are above the eyes' line: larger is higher.
_NEUTRAL = dict(brow=(0.27, 0.27, 0.0), eye=(0.10, "open"), mouth="line")
_POSES = {
    "surprise": dict(brow=(0.44, 0.44, 0.10), eye=(0.17, "open"), mouth="o"),
    "fear": dict(brow=(0.45, 0.30, -0.03), eye=(0.16, "open"), mouth="stretched"),
    "disgust": dict(brow=(0.17, 0.22, 0.0), eye=(0.06, "open"), mouth="sneer"),
    "happiness": dict(brow=(0.31, 0.31, 0.05), eye=(0.10, "smiling"), mouth="smile"),
    "sadness": dict(brow=(0.38, 0.18, 0.0), eye=(0.07, "droopy"), mouth="frown"),
    "anger": dict(brow=(0.10, 0.33, 0.0), eye=(0.05, "open"), mouth="teeth"),
    "neutral": _NEUTRAL,
}


def _lerp(a: float, b: float, t: float) -> float:
    return a + (b - a) * t


class _Pen:
    """Draws in face coordinates onto a supersampled RGBA layer."""

    def __init__(self, draw: ImageDraw.ImageDraw, centre: tuple[float, float], unit: float, ink: tuple, width: int):
        self.draw, self.centre, self.unit, self.ink, self.width = draw, centre, unit, ink, width

    def xy(self, x: float, y: float) -> tuple[float, float]:
        return self.centre[0] + x * self.unit, self.centre[1] + y * self.unit

    def line(self, points: list[tuple[float, float]], width_scale: float = 1.0) -> None:
        self.draw.line([self.xy(*p) for p in points], fill=self.ink, width=max(1, int(self.width * width_scale)),
                       joint="curve")

    def ellipse(self, x: float, y: float, rx: float, ry: float, fill=None, outline: bool = True) -> None:
        (x0, y0), (x1, y1) = self.xy(x - rx, y - ry), self.xy(x + rx, y + ry)
        self.draw.ellipse([x0, y0, x1, y1], fill=fill, outline=self.ink if outline else None,
                          width=self.width if outline else 0)

    def polygon(self, points: list[tuple[float, float]], fill) -> None:
        self.draw.polygon([self.xy(*p) for p in points], fill=fill, outline=self.ink, width=self.width)


def _curve(x0: float, x1: float, y_ends: float, y_mid: float, n: int = 12) -> list[tuple[float, float]]:
    """A parabola from (x0, y_ends) through (mid, y_mid) to (x1, y_ends)."""
    xs = np.linspace(x0, x1, n)
    t = (xs - (x0 + x1) / 2) / ((x1 - x0) / 2)
    return [(float(x), float(y_mid + (y_ends - y_mid) * s * s)) for x, s in zip(xs, t)]


def _draw_brows(pen: _Pen, inner: float, outer: float, arch: float, eye_y: float) -> None:
    for side in (-1, 1):
        xs = np.linspace(0.14, 0.62, 8)
        t = (xs - xs[0]) / (xs[-1] - xs[0])
        ys = eye_y - (inner + (outer - inner) * t + arch * np.sin(np.pi * t))
        pen.line([(side * x, y) for x, y in zip(xs, ys)], width_scale=1.4)


def _draw_eyes(pen: _Pen, rng: np.random.Generator, opening: float, kind: str, eye_y: float, iris) -> None:
    gaze = rng.uniform(-0.03, 0.03, 2)
    for side in (-1, 1):
        x = side * 0.38
        if kind == "smiling":  # closed, upturned arcs
            pen.line(_curve(x - 0.14, x + 0.14, eye_y + 0.03, eye_y - 0.07))
            continue
        pen.ellipse(x, eye_y, 0.15, opening, fill=(255, 255, 255, 255))
        pupil = min(0.06, opening * 0.8)
        pen.ellipse(x + gaze[0], eye_y + gaze[1] * opening / 0.15, pupil, pupil, fill=iris, outline=False)
        if kind == "droopy":  # heavy upper lid, sloping down to the outside
            pen.line([(x - side * 0.16, eye_y - opening * 1.2), (x + side * 0.17, eye_y - opening * 0.2)])


def _draw_mouth(pen: _Pen, rng: np.random.Generator, kind: str, t: float, y: float) -> None:
    w = rng.uniform(0.26, 0.34)
    white, dark = (255, 255, 255, 255), (70, 10, 20, 255)
    if kind == "line":
        pen.line(_curve(-w, w, y, y + rng.uniform(-0.01, 0.01)))
    elif kind == "smile":
        if rng.random() < 0.5:
            pen.line(_curve(-w, w, y - 0.10 * t, y + 0.08 * t))
        else:  # open smile: a "D" on its back
            pen.polygon(_curve(-w, w, y - 0.08 * t, y + 0.14 * t) + [(w * 0.6, y - 0.06 * t), (-w * 0.6, y - 0.06 * t)],
                        white)
    elif kind == "frown":
        pen.line(_curve(-w, w, y + 0.10 * t, y - 0.05 * t))
    elif kind == "o":
        pen.ellipse(0, y + 0.03, _lerp(0.05, 0.12, t), _lerp(0.04, 0.17, t), fill=dark)
    elif kind == "stretched":  # wide, open, corners pulled down, upper teeth showing
        h = _lerp(0.03, 0.09, t)
        upper = _curve(-w * 1.1, w * 1.1, y + 0.04 * t, y - h)
        lower = _curve(w * 1.1, -w * 1.1, y + 0.04 * t, y + h)
        pen.polygon(upper + lower, dark)
        pen.line([(-w * 0.6, y - h * 0.6), (w * 0.6, y - h * 0.6)], width_scale=1.6)
    elif kind == "teeth":  # clenched, bared teeth
        h = _lerp(0.02, 0.06, t)
        pen.polygon([(-w, y - h), (w, y - h), (w, y + h), (-w, y + h)], white)
        pen.line([(-w, y), (w, y)], width_scale=0.6)
        for x in np.linspace(-w, w, 6)[1:-1]:
            pen.line([(x, y - h), (x, y + h)], width_scale=0.6)
    elif kind == "sneer":  # one side of the upper lip pulled up
        side = rng.choice([-1, 1])
        pen.line([(-side * w, y + 0.02), (-side * w * 0.2, y), (side * w * 0.3, y - 0.08 * t),
                  (side * w, y - 0.12 * t)])
        pen.line([(side * w * 0.3, y - 0.08 * t), (side * w * 0.6, y - 0.02)], width_scale=0.8)


def render_face(rng: np.random.Generator, size: int = 112, label: int | None = None) -> Sample:
    """One face; the expression is random unless `label` (an index into LABELS) is given."""
    label = int(rng.integers(len(LABELS))) if label is None else label
    pose, t = _POSES[LABELS[label]], rng.uniform(0.7, 1.0)  # t: intensity, how far from neutral
    s = SUPERSAMPLE
    # Like RAF-DB's aligned crops: the face centred and filling the frame, a little jitter in size,
    # position and roll.
    half_w = rng.uniform(0.36, 0.42) * size
    half_h = min(half_w * rng.uniform(1.08, 1.22), 0.47 * size)
    angle = rng.uniform(-6, 6)
    # Keep the whole (rotated) face inside the image.
    rad = math.radians(angle)
    ext_x = math.hypot(half_w * math.cos(rad), half_h * math.sin(rad))
    ext_y = math.hypot(half_w * math.sin(rad), half_h * math.cos(rad))
    cx = size / 2 + rng.uniform(-1, 1) * min(0.04 * size, size / 2 - ext_x - 1)
    cy = size / 2 + rng.uniform(-1, 1) * min(0.04 * size, size / 2 - ext_y - 1)

    image = background(rng, size)
    # Skin stays light enough for the dark ink of the features to contrast with it.
    skin = np.array([1.0, 0.86, 0.72]) * rng.uniform(0.55, 1.0) if rng.random() < 0.8 else random_colour(rng, 0.45)
    while np.linalg.norm(image.mean((0, 1)) - skin) < 0.3:  # the face must stand out from its background
        skin = random_colour(rng, 0.45)
    ink = tuple(int(v) for v in rng.uniform(0, 60, 3)) + (255,)
    rgba = lambda c: tuple(int(v * 255) for v in c) + (255,)  # noqa: E731

    layer = Image.new("RGBA", (size * s, size * s), (0, 0, 0, 0))
    draw = ImageDraw.Draw(layer)
    pen = _Pen(draw, (cx * s, cy * s), half_w * s, ink, width=max(2, int(rng.uniform(0.05, 0.075) * half_w * s)))
    if rng.random() < 0.6:  # hair: a cap over the top of the head
        pen.ellipse(0, -half_h / half_w * 0.55, 1.02, half_h / half_w * 0.5, fill=rgba(random_colour(rng) * 0.6))
    pen.ellipse(0, 0, 1.0, half_h / half_w, fill=rgba(skin))
    if rng.random() < 0.3:  # cheeks
        for side in (-1, 1):
            pen.ellipse(side * 0.55, 0.2, 0.13, 0.08, fill=rgba(np.array([1.0, 0.55, 0.55])), outline=False)

    eye_y = rng.uniform(-0.22, -0.12)
    inner, outer, arch = (_lerp(n, p, t) for n, p in zip(_NEUTRAL["brow"], pose["brow"]))
    _draw_brows(pen, inner + rng.uniform(-0.02, 0.02), outer + rng.uniform(-0.02, 0.02), arch, eye_y)
    opening = _lerp(_NEUTRAL["eye"][0], pose["eye"][0], t) * rng.uniform(0.9, 1.1)
    _draw_eyes(pen, rng, opening, pose["eye"][1], eye_y, rgba(random_colour(rng) * 0.5))
    pen.line([(0, eye_y + 0.12), (0.04, eye_y + 0.32), (-0.04, eye_y + 0.36)], width_scale=0.8)  # nose
    if LABELS[label] == "disgust":  # wrinkles over the nose bridge
        for side in (-1, 1):
            pen.line([(side * 0.06, eye_y + 0.08), (side * 0.16, eye_y + 0.14)], width_scale=0.7)
            pen.line([(side * 0.07, eye_y + 0.15), (side * 0.17, eye_y + 0.21)], width_scale=0.7)
    _draw_mouth(pen, rng, pose["mouth"], t, rng.uniform(0.45, 0.58))

    layer = layer.rotate(angle, resample=Image.BICUBIC, center=(cx * s, cy * s))
    canvas = Image.fromarray((image * 255).astype(np.uint8)).resize(layer.size, Image.BILINEAR).convert("RGBA")
    canvas = Image.alpha_composite(canvas, layer).convert("RGB").resize((size, size), Image.BOX)
    box = (int(cx - ext_x), int(cy - ext_y), int(round(2 * ext_x)), int(round(2 * ext_y)))
    return Sample(finish(rng, np.asarray(canvas, dtype=np.float32) / 255), label, box)


def faces(seed: int, count: int, size: int = 112) -> list[Sample]:
    """`count` faces, expressions balanced (sample i shows expression i mod 7)."""
    return [render_face(sample_rng(seed, i), size, label=i % len(LABELS)) for i in range(count)]
