"""Face detection and alignment (service/pipeline/faces.py) over the embedded repository's MTCNN: its pieces on known
geometry, and the detector on scenes of real faces (tests/face_scenes.py)."""
import numpy as np
import pytest
from face_scenes import ASTRONAUT_FACE, found, lfw_scenes
from PIL import Image, ImageDraw
from service_process import ROOT
from skimage import data as photos

from repository import face_detector, scan, servable
from service.pipeline.faces import TEMPLATE, DetectorSettings, FaceDetector, align, crops, nms, similarity
from service.engine.runtime import CPU

REPO = ROOT / "model_repository"
SETTINGS = DetectorSettings(min_size=32, max_faces=20, max_side=1024)


@pytest.fixture(scope="module")
def detector() -> FaceDetector:
    entry, problem = face_detector(REPO)
    assert problem is None
    return FaceDetector(entry, [CPU])


def test_the_detector_is_in_the_repository_but_not_a_model_clients_call():
    assert "mtcnn" in {e.name for e in scan(REPO)[0]}
    models, problems = servable(REPO)
    assert "mtcnn" not in {e.name for e in models} and "mtcnn" not in problems


def test_similarity_recovers_a_turn_a_scale_and_a_shift():
    angle, scale, shift = np.radians(25), 0.4, np.array([13.0, -7.0])
    turn = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    points = np.random.default_rng(0).uniform(0, 300, (3, 5, 2))
    targets = points[0] @ (scale * turn).T + shift
    (matrix, *_) = similarity(points, targets)
    np.testing.assert_allclose(matrix, np.hstack([scale * turn, shift[:, None]]), atol=1e-9)


def test_a_face_is_aligned_with_its_landmarks_on_the_template():
    """Five dots on a photo, turned and scaled: after alignment each sits where the template puts it."""
    photo = Image.new("RGB", (900, 700))
    draw = ImageDraw.Draw(photo)
    angle, scale = np.radians(-20), 3.1
    turn = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
    marks = (TEMPLATE * 112 - 56) @ (scale * turn).T + [450, 350]
    for x, y in marks:
        draw.ellipse([x - 6, y - 6, x + 6, y + 6], fill=(255, 255, 255))
    (face,) = align(photo, marks[None], (112, 112))
    pixels = np.asarray(face)[:, :, 0].astype(float)
    assert face.size == (112, 112)
    for x, y in TEMPLATE * 112:  # each dot's centre of brightness near its template point
        ys, xs = np.mgrid[int(y) - 8:int(y) + 9, int(x) - 8:int(x) + 9]
        weight = pixels[ys, xs]
        assert np.hypot((xs * weight).sum() / weight.sum() - x, (ys * weight).sum() / weight.sum() - y) < 1.0


def test_crops_are_zero_beyond_the_photo_and_resized_within_it():
    photo = Image.new("RGB", (100, 80), (200, 100, 50))
    out = crops(photo, np.array([[-50.0, -40.0, 50.0, 40.0], [10.0, 10.0, 30.0, 30.0]]), 24)
    assert out.shape == (2, 24, 24, 3) and out.dtype == np.uint8
    assert (out[0, :12, :12] == 0).all() and (out[0, 12:, 12:] == [200, 100, 50]).all()
    assert (out[1] == [200, 100, 50]).all()


def test_nms_keeps_the_best_of_overlapping_boxes():
    boxes = np.array([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30], [2, 2, 8, 8]], np.float64)
    scores = np.array([0.8, 0.9, 0.7, 0.95])
    assert nms(boxes, scores, 0.5).tolist() == [3, 1, 2]  # box 0 overlaps box 1 by 0.68
    assert nms(boxes, scores, 0.7, by_smaller=True).tolist() == [3, 2]  # box 3 lies inside 0 and 1


def test_the_astronauts_face_and_landmarks(detector):
    faces = detector.detect(Image.fromarray(photos.astronaut()), SETTINGS)
    x, y, w, h = ASTRONAUT_FACE
    assert len(faces) == 1 and faces.scores[0] > 0.99
    assert found(faces.boxes, (x + w / 2, y + h / 2, w))
    assert ((faces.landmarks[0] >= [x, y]) & (faces.landmarks[0] <= [x + w, y + h])).all()


@pytest.mark.parametrize("side", [100, 40])
def test_lfw_subsets_faces_are_found_and_its_non_faces_are_not(detector, side):
    """The 100 faces and 100 non-faces of scikit-image's lfw_subset, each 25 x 25 crop at 100 or 40 pixels on grey:
    MTCNN finds 99 and 100 faces and no false one; OpenCV's Haar cascade found 97 and 89, and no false one
    (bench/face_detection.py)."""
    faces, non_faces, target = lfw_scenes(side, 2 * side)
    assert sum(found(detector.detect(scene, SETTINGS).boxes, target) for scene in faces) >= 97
    assert sum(len(detector.detect(scene, SETTINGS)) for scene in non_faces) == 0


def test_max_faces_keeps_the_largest_and_min_size_drops_the_small(detector):
    scene = Image.new("RGB", (700, 300), (128, 128, 128))
    lfw = (photos.lfw_subset()[:3] * 255).astype(np.uint8)
    for (left, side), crop in zip([(20, 200), (300, 120), (500, 60)], lfw):
        scene.paste(Image.fromarray(crop).resize((side, side), Image.BICUBIC).convert("RGB"), (left, 40))
    sides = lambda faces: sorted(np.rint(faces.boxes[:, 2] - faces.boxes[:, 0]) // 50)  # noqa: E731
    everything = detector.detect(scene, SETTINGS)
    assert len(everything) == 3
    two = detector.detect(scene, DetectorSettings(32, 2, 1024))
    assert sides(two) == sides(everything)[1:]
    assert len(detector.detect(scene, DetectorSettings(100, 20, 1024))) == 2
