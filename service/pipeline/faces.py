"""Faces in a photo: MTCNN (Zhang et al., 2016) over the repository's face detector, and each face aligned by its
five landmarks into a square crop for the expression model.

The cascade is the paper's, in numpy per image: P-Net runs over an image pyramid and proposes 12-pixel windows;
R-Net (24 x 24 crops) and then O-Net (48 x 48) rescore and refine the survivors, one batch each, and O-Net adds
the landmarks. Crops are zero beyond the photo's edges, as the paper pads them. A face is then mapped by the
similarity transform (Umeyama's least squares) that puts its landmarks nearest a canonical template, as aligned
face datasets such as RAF-DB are made.

The detector runs in the process that decodes (each HTTP worker under the process backend), on the CPU, in the
request's decode thread: R-Net and O-Net batch one photo's candidates, not several requests'.
"""
import threading
from dataclasses import dataclass

import numpy as np
from PIL import Image

from repository import ModelEntry
from service.core.errors import TooLarge
from service.engine.runtime import open_session
from service.images.decode import Photo

# Where the five landmarks (eyes, nose, mouth corners) of an aligned face sit, as fractions of the crop's side:
# the 112-pixel template common to aligned face crops (InsightFace's), which keeps brows and chin in frame.
TEMPLATE = np.array([[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366], [41.5493, 92.3655],
                     [70.7299, 92.2041]], np.float64) / 112


@dataclass(frozen=True)
class DetectorSettings:
    min_size: int  # the smallest face side, in the photo's pixels, worth looking for
    max_faces: int
    max_side: int  # detection runs on a copy at most this large


@dataclass
class Faces:
    """Faces found in a photo, largest first, in its pixels."""
    boxes: np.ndarray  # [n, 4] float: x0, y0, x1, y1
    scores: np.ndarray  # [n]: O-Net's face probability
    landmarks: np.ndarray  # [n, 5, 2]: (x, y) of the detector's landmarks, in its order

    def __len__(self) -> int:
        return len(self.scores)

    def scaled(self, factor: float) -> "Faces":
        """The same faces in pixels `factor` times as large (those of the upload, found on a reduced decode)."""
        return Faces(self.boxes * factor, self.scores, self.landmarks * factor)


class FaceDetector:
    """MTCNN's three graphs (export/face_detector.py) in ONNX Runtime sessions, which several threads may run at
    once."""

    def __init__(self, entry: ModelEntry, providers: list[str], threads: int = 1):
        spec = entry.manifest["nets"]
        self.name, self.input = entry.name, entry.manifest["input"]["name"]
        self.landmark_names: list[str] = entry.manifest["landmarks"]
        self.window, self.stride = spec["pnet"]["window"], spec["pnet"]["stride"]
        self.crops = {net: spec[net]["crop"] for net in ("rnet", "onet")}
        self.thresholds = {net: spec[net]["threshold"] for net in spec}
        self.factor = entry.manifest["pyramid_factor"]
        # no arena: P-Net runs at every pyramid level's size, and several decode threads at once, so that ORT's
        # arena would keep the peak of a crowd of large photos for good (a refused crowd held 600 MB)
        self.sessions = {net: open_session(entry.path(net), providers, threads, memory_arena=False) for net in spec}
        self.provider = self.sessions["pnet"].get_providers()[0]

    def detect(self, image: Image.Image, settings: DetectorSettings) -> Faces:
        """The faces of an RGB photo, largest first, at most settings.max_faces."""
        scale = min(1.0, settings.max_side / max(image.size))
        small = image if scale == 1.0 else image.resize(
            (max(1, round(image.width * scale)), max(1, round(image.height * scale))), Image.BILINEAR)
        boxes = self._propose(small, settings.min_size * scale)
        if len(boxes):
            boxes, (offsets, scores) = self._passing("rnet", small, boxes)
            keep = nms(boxes, scores, 0.7)
            boxes = square(regress(boxes[keep], offsets[keep]))
        faces = Faces(np.zeros((0, 4)), np.zeros(0), np.zeros((0, 5, 2)))
        if len(boxes):
            boxes, (offsets, marks, scores) = self._passing("onet", small, boxes)
            # O-Net's landmarks: five x, then five y, as fractions of the box it saw
            landmarks = boxes[:, None, :2] + marks.reshape(-1, 2, 5).transpose(0, 2, 1) * (
                boxes[:, None, 2:] - boxes[:, None, :2])
            boxes = regress(boxes, offsets)
            keep = nms(boxes, scores, 0.7, by_smaller=True)
            faces = Faces(boxes[keep] / scale, scores[keep], landmarks[keep] / scale)
        order = np.argsort(-(faces.boxes[:, 2] - faces.boxes[:, 0]) * (faces.boxes[:, 3] - faces.boxes[:, 1]),
                           kind="stable")[: settings.max_faces]
        return Faces(faces.boxes[order], faces.scores[order], faces.landmarks[order])

    def _propose(self, image: Image.Image, min_size: float) -> np.ndarray:
        """P-Net's candidate boxes [n, 4] over the pyramid, regressed and made square (the cascade's first stage):
        scales from the one that makes a `min_size` face a 12-pixel window (never above the copy's own), down
        to the photo at 12 pixels."""
        first = min(1.0, self.window / max(min_size, 1.0))
        scales, side = [], min(image.size) * first
        while side >= self.window:
            scales.append(first * self.factor ** len(scales))
            side *= self.factor
        found, level = [], image
        for s in scales:  # each level resized from the one before: the source shrinks with the levels
            level = level.resize((int(image.width * s + 1), int(image.height * s + 1)), Image.BILINEAR)
            offsets, scores = self.sessions["pnet"].run(None, {self.input: np.asarray(level)[None]})
            ys, xs = np.nonzero(scores[0] >= self.thresholds["pnet"])
            windows = np.stack([xs, ys, xs, ys], axis=1) * self.stride + np.array([0, 0, 1, 1]) * self.window
            boxes, box_scores = windows / s, scores[0, ys, xs]
            keep = nms(boxes, box_scores, 0.5)
            found.append(np.concatenate([boxes[keep], box_scores[keep, None], offsets[0][:, ys, xs].T[keep]], 1))
        found = np.concatenate(found) if found else np.zeros((0, 9))
        found = found[nms(found[:, :4], found[:, 4], 0.7)]
        return square(regress(found[:, :4], found[:, 5:]))

    def _passing(self, net: str, image: Image.Image, boxes: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """The boxes whose crops R-Net or O-Net scores as faces, and the net's outputs for them."""
        outputs = self.sessions[net].run(None, {self.input: crops(image, boxes, self.crops[net])})
        passed = outputs[-1] >= self.thresholds[net]
        return boxes[passed], [output[passed] for output in outputs]


def regress(boxes: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Boxes moved by the nets' offsets, fractions of their width and height for each side."""
    size = boxes[:, 2:4] - boxes[:, :2]
    return boxes + offsets * np.concatenate([size, size], axis=1)


def square(boxes: np.ndarray) -> np.ndarray:
    """Each box grown to a square on its longer side, about its centre (what R-Net and O-Net see)."""
    centre, side = (boxes[:, :2] + boxes[:, 2:]) / 2, (boxes[:, 2:] - boxes[:, :2]).max(axis=1, keepdims=True)
    return np.concatenate([centre - side / 2, centre + side / 2], axis=1)


def nms(boxes: np.ndarray, scores: np.ndarray, threshold: float, by_smaller: bool = False) -> np.ndarray:
    """Greedy non-maximum suppression: indices of the boxes kept, best first. Overlap is intersection over union,
    or over the smaller box with `by_smaller` (O-Net's last pass: a box inside a better one goes)."""
    area = np.prod(np.maximum(boxes[:, 2:] - boxes[:, :2], 0), axis=1)
    order, keep = np.argsort(-scores, kind="stable"), []
    while order.size:
        best, rest = order[0], order[1:]
        keep.append(best)
        corner0, corner1 = np.maximum(boxes[best, :2], boxes[rest, :2]), np.minimum(boxes[best, 2:], boxes[rest, 2:])
        inter = np.prod(np.maximum(corner1 - corner0, 0), axis=1)
        base = np.minimum(area[best], area[rest]) if by_smaller else area[best] + area[rest] - inter
        order = rest[inter <= threshold * base]
    return np.array(keep, np.int64)


def crops(image: Image.Image, boxes: np.ndarray, side: int) -> np.ndarray:
    """uint8 [n, side, side, 3]: each box of the photo resized (antialiased), zero where it lies beyond the
    photo's edges."""
    out = np.zeros((len(boxes), side, side, 3), np.uint8)
    inside = np.clip(boxes, 0, [*image.size, *image.size])
    # where each box's part inside the photo lands in its crop
    spots = np.rint((inside - boxes[:, [0, 1, 0, 1]]) * side / (boxes[:, [2, 3, 2, 3]] - boxes[:, [0, 1, 0, 1]]))
    spots = spots.astype(np.int64)
    for i, ((x0, y0, x1, y1), box) in enumerate(zip(spots, inside)):
        if x1 > x0 and y1 > y0 and box[2] > box[0] and box[3] > box[1]:
            out[i, y0:y1, x0:x1] = np.asarray(image.resize((x1 - x0, y1 - y0), Image.BILINEAR, box=tuple(box)))
    return out


def similarity(points: np.ndarray, template: np.ndarray) -> np.ndarray:
    """[n, 2, 3] affine matrices: for each face's points [n, k, 2], the rotation, uniform scale and shift that map
    them nearest the template [k, 2] in least squares (Umeyama, 1991)."""
    src_mean, dst_mean = points.mean(axis=1, keepdims=True), template.mean(axis=0)
    src, dst = points - src_mean, template - dst_mean
    u, sigma, vt = np.linalg.svd(np.einsum("ki,nkj->nij", dst, src) / len(template))
    d = np.ones_like(sigma)
    d[:, 1] = np.sign(np.linalg.det(u) * np.linalg.det(vt))  # a reflection is never a face's pose
    rotation = u @ (d[:, :, None] * vt)
    scale = (sigma * d).sum(axis=1) / src.var(axis=1).sum(axis=1)
    shift = dst_mean - scale[:, None] * np.einsum("nij,nj->ni", rotation, src_mean[:, 0])
    return np.concatenate([scale[:, None, None] * rotation, shift[:, :, None]], axis=2)


def align(image: Image.Image, landmarks: np.ndarray, size: tuple[int, int]) -> list[Image.Image]:
    """Each face as a crop of `size` (width, height) with its landmarks on the template. The region it comes from
    is first reduced by a whole factor (antialiased) where it is more than twice the crop, so that bilinear
    sampling does not alias."""
    w, h = size
    corners = np.array([[0, 0, 1], [w, 0, 1], [0, h, 1], [w, h, 1]], np.float64).T
    faces = []
    for matrix in similarity(landmarks, TEMPLATE * np.array(size, np.float64)):
        inverse = np.linalg.inv(np.vstack([matrix, [0, 0, 1]]))  # crop pixels -> photo pixels
        spread = (inverse @ corners)[:2]
        x0, y0 = np.clip(np.floor(spread.min(axis=1)), 0, image.size).astype(int)
        x1, y1 = np.clip(np.ceil(spread.max(axis=1)), 0, image.size).astype(int)
        if x1 <= x0 or y1 <= y0:  # landmarks wholly outside the photo: nothing to show
            faces.append(Image.new("RGB", size))
            continue
        factor = max(1, int(np.sqrt(abs(np.linalg.det(inverse[:2, :2])))) // 2)
        source = image.reduce(factor, box=(x0, y0, x1, y1))
        to_source = np.array([[1 / factor, 0, -x0 / factor], [0, 1 / factor, -y0 / factor], [0, 0, 1]])
        faces.append(source.transform(size, Image.AFFINE, (to_source @ inverse)[:2].ravel(), Image.BILINEAR))
    return faces


@dataclass
class FoundFaces:
    """One photo's faces, found and aligned (Pipeline.find_faces), on their way to their batch (run_faces)."""
    size: tuple[int, int]  # the photo's upright (width, height)
    found: Faces | None  # None without detection: the photo itself is the one face
    crops: list[Photo]  # each face aligned, what the model's input is made from
    found_ms: float  # to decode, detect and align


class FaceBudget:
    """The faces one /expression request may have classified, all its photos together: more than the model's queue
    holds could never run, and VITSERVE_FACE_REQUEST_MAX may allow fewer. Its photos are detected in several decode
    threads at once; once their faces pass the budget, those not yet detected are not, and the request is a 413."""

    def __init__(self, limit: int):
        self.limit, self.found = limit, 0
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        with self._lock:
            self.found += n

    @property
    def spent(self) -> bool:
        """The request's faces found so far are past its budget."""
        return self.found > self.limit

    def check(self) -> None:
        """TooLarge once the request's faces found so far are past its budget."""
        if self.spent:
            raise TooLarge(f"this request's photos hold more than {self.limit} faces (at least {self.found}), the "
                           "most one request may have classified (VITSERVE_FACE_REQUEST_MAX, within the model's "
                           "queue limit): send fewer photos at once, or ask for fewer max_faces", "too_many_faces")
