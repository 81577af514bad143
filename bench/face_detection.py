"""Face detection: MTCNN (the service's detector, service/pipeline/faces.py) against OpenCV's Haar cascade, the detector
it replaced, on the same real-photograph scenes (tests/face_scenes.py):

  - the astronaut: the box's IoU with Haar's, and whether the landmarks lie inside it;
  - scikit-image's lfw_subset: each 25 x 25 crop upscaled to 100 pixels, and to 40 (near the smallest face
    looked for, 32), in the middle of a grey canvas twice as large; recall on its 100 faces, false faces on its
    100 non-faces;
  - a group photo: five faces of 70 to 180 pixels in each of five rows turned -30, -15, 0, 15, 30 degrees;
  - latency per image at 0.5 and 8 megapixels (the astronaut upscaled), median of --rounds, the two detectors
    interleaved, each on one thread (as each decode thread runs one).

    python bench/face_detection.py            # Haar needs opencv-python-headless < 5 (not a vitserve dependency):
    pip install 'opencv-python-headless<5'    # without it only MTCNN's figures print

With --expression URL [URL ...], it times POST /expression of the astronaut (JPEG) instead, one request at a
time, alternating between the services (say, this tree and an older one started from a git worktree on another
port), and prints each one's median and p90 over --rounds requests.
"""
import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image
from skimage import data as photos

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from face_scenes import ASTRONAUT_FACE, found, group_photo, lfw_scenes  # noqa: E402

from repository import face_detector  # noqa: E402
from service.pipeline.faces import DetectorSettings, FaceDetector  # noqa: E402
from service.engine.runtime import CPU  # noqa: E402

SETTINGS = DetectorSettings(min_size=32, max_faces=100, max_side=1024)  # the service's defaults


class Haar:
    """The service's detector before MTCNN: the frontal-face cascade at its settings then (scale 1.1, 5
    neighbours, 32-pixel faces, on a copy at most 1024 pixels large)."""

    def __init__(self):
        import cv2
        self.cv2 = cv2
        self.cascade = cv2.CascadeClassifier(cv2.data.haarcascades + "haarcascade_frontalface_default.xml")

    def __call__(self, image: Image.Image) -> np.ndarray:
        scale = min(1.0, SETTINGS.max_side / max(image.size))
        gray = image.convert("L")
        if scale < 1.0:
            gray = gray.resize((round(gray.width * scale), round(gray.height * scale)), Image.BILINEAR)
        side = max(1, round(SETTINGS.min_size * scale))
        found = self.cascade.detectMultiScale(np.asarray(gray), scaleFactor=1.1, minNeighbors=5, minSize=(side, side))
        boxes = np.array(found, np.float64).reshape(-1, 4) / scale
        return np.concatenate([boxes[:, :2], boxes[:, :2] + boxes[:, 2:]], axis=1)


def iou(a: np.ndarray, b: np.ndarray) -> float:
    inter = np.prod(np.maximum(np.minimum(a[2:], b[2:]) - np.maximum(a[:2], b[:2]), 0))
    return float(inter / (np.prod(a[2:] - a[:2]) + np.prod(b[2:] - b[:2]) - inter))


def accuracy(detectors: dict) -> None:
    x, y, w, h = ASTRONAUT_FACE
    haar_box = np.array([x, y, x + w, y + h], np.float64)
    astronaut = Image.fromarray(photos.astronaut())
    lfw = {side: lfw_scenes(side, 2 * side) for side in (100, 40)}
    group, members = group_photo()
    print("| detector | astronaut IoU with Haar's box | lfw faces found (of 100) at 100 / 40 px | false faces on "
          "lfw non-faces (100 scenes) at 100 / 40 px | group photo: found at -30/-15/0/15/30 degrees (5 each) | "
          "false faces in the group |")
    print("|---|---|---|---|---|---|")
    for name, detect in detectors.items():
        boxes = detect(astronaut)
        overlap = max((iou(b, haar_box) for b in boxes), default=0.0)
        recall = " / ".join(str(sum(found(detect(scene), target) for scene in faces))
                            for faces, _, target in lfw.values())
        false = " / ".join(str(sum(len(detect(scene)) for scene in non_faces)) for _, non_faces, _ in lfw.values())
        in_group = detect(group)
        by_angle = {}
        for member in members:
            by_angle[member[3]] = by_angle.get(member[3], 0) + found(in_group, member)
        strays = sum(not any(found(box[None], m) for m in members) for box in in_group)
        print(f"| {name} | {overlap:.2f} | {recall} | {false} | {'/'.join(map(str, by_angle.values()))} | {strays} |")


def latency(detectors: dict, rounds: int) -> None:
    photo = Image.fromarray(photos.astronaut())
    sizes = {"0.5 MP": (707, 707), "8 MP": (2828, 2828)}
    print("\n| photo | " + " | ".join(f"{name} ms (median)" for name in detectors) + " |")
    print("|---|" + "---|" * len(detectors))
    for label, size in sizes.items():
        image = photo.resize(size, Image.BICUBIC)
        times = {name: [] for name in detectors}
        for _ in range(rounds):  # interleaved: the machine's noise falls on both alike
            for name, detect in detectors.items():
                start = time.perf_counter()
                detect(image)
                times[name].append((time.perf_counter() - start) * 1e3)
        print(f"| {label} {size[0]}x{size[1]} | " + " | ".join(f"{statistics.median(t):.1f}" for t in times.values())
              + " |")


def expression_latency(urls: list[str], rounds: int) -> None:
    buffer = io.BytesIO()
    Image.fromarray(photos.astronaut()).save(buffer, "JPEG", quality=90)
    times = {url: [] for url in urls}
    with httpx.Client(timeout=60) as client:
        for i in range(rounds + 5):
            for url in urls:
                start = time.perf_counter()
                r = client.post(f"{url}/expression", files={"file": ("astronaut.jpg", buffer.getvalue())})
                r.raise_for_status()
                if i >= 5:  # the first few warm both up
                    times[url].append((time.perf_counter() - start) * 1e3)
    print("| service | faces | p50 ms | p90 ms |\n|---|---|---|---|")
    for url, t in times.items():
        faces = len(httpx.post(f"{url}/expression", files={"file": ("a.jpg", buffer.getvalue())}).json()["faces"])
        print(f"| {url} | {faces} | {statistics.median(t):.1f} | {np.percentile(t, 90):.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--expression", nargs="+", metavar="URL", help="time POST /expression on these services")
    args = parser.parse_args()
    if args.expression:
        return expression_latency(args.expression, args.rounds)
    entry, why = face_detector(args.repository)
    if entry is None:
        sys.exit(f"error: {why}")
    mtcnn = FaceDetector(entry, [CPU], threads=1)
    detectors = {"MTCNN": lambda image: mtcnn.detect(image, SETTINGS).boxes}
    try:
        detectors["Haar"] = Haar()
    except ImportError:
        print("(no OpenCV here: MTCNN only; pip install 'opencv-python-headless<5' for Haar's figures)")
    accuracy(detectors)
    latency(detectors, args.rounds)


if __name__ == "__main__":
    main()
