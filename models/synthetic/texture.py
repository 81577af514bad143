"""Random textured backgrounds and finishing noise, as float RGB arrays in [0, 1]."""
import numpy as np
from PIL import Image


LUMA = np.array([0.299, 0.587, 0.114])  # ITU-R BT.601 luma weights


def random_colour(rng: np.random.Generator, low: float = 0.0, high: float = 1.0) -> np.ndarray:
    return rng.uniform(low, high, 3)


def _pattern(rng: np.random.Generator, size: int) -> np.ndarray:
    """One of a few texture kinds as an [H, W] map in [0, 1]."""
    yy, xx = np.mgrid[0:size, 0:size] / size
    kind = rng.integers(5)
    if kind == 0:  # blotches: coarse noise upsampled
        cells = int(rng.integers(3, 9))
        coarse = Image.fromarray((rng.uniform(0, 1, (cells, cells)) * 255).astype(np.uint8))
        return np.asarray(coarse.resize((size, size), Image.BICUBIC), dtype=np.float32) / 255
    if kind == 1:  # stripes at a random angle
        angle, period = rng.uniform(0, np.pi), rng.uniform(0.06, 0.25)
        return 0.5 + 0.5 * np.sin(2 * np.pi * (xx * np.cos(angle) + yy * np.sin(angle)) / period)
    if kind == 2:  # checkerboard
        cell = rng.uniform(0.06, 0.2)
        return ((np.floor(xx / cell) + np.floor(yy / cell)) % 2).astype(np.float32)
    if kind == 3:  # linear gradient
        angle = rng.uniform(0, 2 * np.pi)
        ramp = xx * np.cos(angle) + yy * np.sin(angle)
        return (ramp - ramp.min()) / (np.ptp(ramp) + 1e-6)
    return rng.uniform(0, 1, (size, size))  # fine grain


def background(rng: np.random.Generator, size: int, low: float = 0.0) -> np.ndarray:
    """[size, size, 3] texture blended between two random colours with channels in [low, 1]."""
    t = _pattern(rng, size)[..., None]
    c1, c2 = random_colour(rng, low), random_colour(rng, low)
    contrast = rng.uniform(0.1, 0.6)  # how far the texture's second colour pulls from the first
    return c1 * (1 - contrast * t) + c2 * (contrast * t)


def finish(rng: np.random.Generator, image: np.ndarray) -> Image.Image:
    """Add sensor-like noise and quantise to an 8-bit RGB image."""
    noisy = image + rng.normal(0, rng.uniform(0.0, 0.05), image.shape)
    return Image.fromarray((np.clip(noisy, 0, 1) * 255).round().astype(np.uint8))
