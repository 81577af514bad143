"""Faces in a photo: OpenCV's frontal-face Haar cascade (it ships inside opencv-python-headless 4.x; OpenCV 5
dropped the cascades), and square crops around them for the expression model."""
import math
import threading
from dataclasses import dataclass

import numpy as np
from PIL import Image

from .errors import Unavailable

try:
    import cv2
except ImportError:  # the service still serves; face detection answers 503
    cv2 = None

CASCADE = "haarcascade_frontalface_default.xml"
_local = threading.local()  # a CascadeClassifier is not safe to share between threads


@dataclass(frozen=True)
class DetectorSettings:
    scale_factor: float
    min_neighbors: int
    min_size: int
    max_faces: int
    max_side: int


def _cascade():
    """This thread's cascade; Unavailable where this OpenCV has none (not installed, 5.x, or an image's build
    without the Haar API, as on the GPU hosts' image)."""
    if not hasattr(_local, "cascade"):
        try:
            cascade = cv2.CascadeClassifier(cv2.data.haarcascades + CASCADE)
            loaded = not cascade.empty()
        except (AttributeError, TypeError):
            loaded = False
        if not loaded:
            raise Unavailable(f"face detection is unavailable on this server: its OpenCV has no {CASCADE} "
                              "(opencv-python-headless < 5 ships it); send aligned face crops with detect=false",
                              "face_detection_unavailable")
        _local.cascade = cascade
    return _local.cascade


def detect_faces(image: Image.Image, settings: DetectorSettings) -> list[tuple[int, int, int, int]]:
    """Face boxes [x, y, w, h] in the image's pixels, largest first, at most settings.max_faces."""
    gray = image.convert("L")
    scale = min(1.0, settings.max_side / max(image.size))
    if scale < 1.0:
        gray = gray.resize((round(gray.width * scale), round(gray.height * scale)), Image.BILINEAR)
    side = max(1, math.ceil(settings.min_size * scale))
    found = _cascade().detectMultiScale(np.asarray(gray), scaleFactor=settings.scale_factor,
                                        minNeighbors=settings.min_neighbors, minSize=(side, side))
    boxes = [tuple(round(int(v) / scale) for v in box) for box in found]
    return sorted(boxes, key=lambda b: -b[2] * b[3])[: settings.max_faces]


def crop_face(image: Image.Image, box: tuple[int, int, int, int], margin: float) -> Image.Image:
    """A square around the box's centre, `margin` of its size added on every side (black beyond the edges)."""
    x, y, w, h = box
    side = max(w, h) * (1 + 2 * margin)
    cx, cy = x + w / 2, y + h / 2
    return image.crop((round(cx - side / 2), round(cy - side / 2), round(cx + side / 2), round(cy + side / 2)))
