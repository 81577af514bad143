import json

import numpy as np
import pytest

from models.synthetic import __main__ as cli
from models.synthetic import sample_rng
from models.synthetic.faces import LABELS as FACE_LABELS
from models.synthetic.faces import faces
from models.synthetic.shapes import LABELS as SHAPE_LABELS
from models.synthetic.shapes import render_shape, shapes


@pytest.mark.parametrize("generate", [shapes, faces])
def test_generators_are_deterministic_by_seed(generate):
    a, b, c = generate(0, 8), generate(0, 8), generate(1, 8)
    assert all(np.array_equal(x.image, y.image) and x.box == y.box for x, y in zip(a, b))
    assert not any(np.array_equal(x.image, z.image) for x, z in zip(a, c))


def test_labels_are_balanced():
    assert [s.label for s in shapes(3, 12)] == [i % len(SHAPE_LABELS) for i in range(12)]
    assert [s.label for s in faces(3, 14)] == [i % len(FACE_LABELS) for i in range(14)]


def test_shape_box_is_where_the_shape_was_drawn():
    for i in range(20):
        sample = render_shape(sample_rng(5, i), size=96, centre=(30.0, 62.0))
        x, y, w, h = sample.box
        # drawn around the centre asked for; a heart's or a triangle's box is not symmetric about it
        assert abs(x + w / 2 - 30) <= 0.15 * w + 1 and abs(y + h / 2 - 62) <= 0.15 * h + 1, sample.box
        assert 0.15 * 96 <= max(w, h) <= 2 * 0.24 * 96 + 2


def test_face_boxes_lie_inside_the_image():
    for sample in faces(7, 21):
        x, y, w, h = sample.box
        assert x >= 0 and y >= 0 and x + w <= 112 and y + h <= 112 and w > 112 * 0.6


def test_cli_writes_an_image_folder(tmp_path):
    cli.main(["shapes", "--out", str(tmp_path), "--train", "12", "--val", "6", "--workers", "1"])
    assert (tmp_path / "labels.txt").read_text().split() == list(SHAPE_LABELS)
    for split, count in (("train", 12), ("val", 6)):
        boxes = json.loads((tmp_path / split / "boxes.json").read_text())
        assert len(boxes) == count == len(list((tmp_path / split).glob("*/*.png")))
        assert all((tmp_path / split / name).is_file() for name in boxes)
