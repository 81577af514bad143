"""Synthetic, seeded datasets for the demo models: shapes with boxes, and cartoon faces with expressions.

Sample i of a dataset depends only on (seed, i), so any sample can be regenerated on its own.
"""
from dataclasses import dataclass

import numpy as np
from PIL import Image


@dataclass
class Sample:
    image: Image.Image
    label: int
    box: tuple[int, int, int, int]  # the object's x, y, width, height in pixels
    colour: tuple[float, float, float] | None = None  # a shape's RGB in [0, 1], for its caption (models.shapes_clip)


def sample_rng(seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, index])
