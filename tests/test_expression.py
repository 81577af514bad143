"""POST /expression end to end: real photographs, a collage of real faces, and the synthetic held-out faces."""
import io
import json

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image
from service_process import ROOT, metric, photo_bytes, running_service
from skimage import data as photos

from models.synthetic import sample_rng
from models.synthetic.faces import render_face
from repository import graph_inputs

# Eileen Collins's face in skimage's astronaut (512 x 512), checked by eye once: brow to chin, ear to ear.
ASTRONAUT_FACE = (182, 70, 90, 92)
LFW_FACES = (0, 1, 2, 3, 5)  # frontal faces of skimage's lfw_subset


@pytest.fixture(scope="module")
def url():
    with running_service() as base:
        yield base


def post(url: str, data: bytes, **params) -> httpx.Response:
    return httpx.post(f"{url}/expression", files={"file": ("photo", data)}, params=params, timeout=60)


def iou(a, b) -> float:
    ax, ay, aw, ah = a
    bx, by, bw, bh = b
    w = max(0, min(ax + aw, bx + bw) - max(ax, bx))
    h = max(0, min(ay + ah, by + bh) - max(ay, by))
    return w * h / (aw * ah + bw * bh - w * h)


def encode(image: Image.Image, fmt: str = "JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_astronaut_has_one_face_where_it_is(url):
    r = post(url, photo_bytes("astronaut", "JPEG"))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "expression-vit" and body["image_size"] == [512, 512]
    (face,) = body["faces"]
    assert iou(face["box"], ASTRONAUT_FACE) >= 0.5
    labels = json.loads((ROOT / "model_repository" / "expression-vit" / "manifest.json").read_text())["labels"]
    assert list(face["probabilities"]) == labels == ["surprise", "fear", "disgust", "happiness", "sadness", "anger",
                                                     "neutral"]
    assert abs(sum(face["probabilities"].values()) - 1) < 1e-6
    assert face["expression"] == max(face["probabilities"], key=face["probabilities"].get)


def test_no_face_is_an_empty_list(url):
    r = post(url, photo_bytes("coffee", "JPEG"))
    assert r.status_code == 200 and r.json()["faces"] == []


def test_exif_rotated_and_grayscale_photos(url):
    upright = Image.fromarray(photos.astronaut())
    exif = Image.Exif()
    exif[0x0112] = 8  # stored turned 90 degrees clockwise; the viewer turns it back
    stored = upright.transpose(Image.Transpose.ROTATE_270)
    (face,) = post(url, encode(stored, exif=exif, quality=95)).json()["faces"]
    assert iou(face["box"], ASTRONAUT_FACE) >= 0.5
    (face,) = post(url, encode(upright.convert("L"))).json()["faces"]
    assert iou(face["box"], ASTRONAUT_FACE) >= 0.5


def test_a_collage_gets_one_box_per_face_all_in_one_batch(url):
    lfw = photos.lfw_subset()
    canvas, pasted = Image.new("L", (5 * 170 + 40, 240), 128), []
    for i, k in enumerate(LFW_FACES):
        canvas.paste(Image.fromarray((lfw[k] * 255).astype(np.uint8)).resize((120, 120), Image.BICUBIC),
                     (40 + i * 170, 60))
        pasted.append((40 + i * 170, 60, 120, 120))
    before = httpx.get(f"{url}/metrics").text
    faces = post(url, encode(canvas, "PNG")).json()["faces"]
    assert len(faces) == len(pasted)
    assert all(max(iou(f["box"], p) for f in faces) >= 0.5 for p in pasted)
    assert all(f["batch_size"] == len(pasted) for f in faces)
    after = httpx.get(f"{url}/metrics").text
    five = {"model": "expression-vit", "le": "8.0"}
    four = {"model": "expression-vit", "le": "4.0"}
    grew = lambda labels: metric(after, "vitserve_batch_size_bucket", **labels) - metric(before, "vitserve_batch_size_bucket", **labels)  # noqa: E731
    assert grew(five) == 1 and grew(four) == 0  # one inference call of 5 faces
    assert len(post(url, encode(canvas, "PNG"), max_faces=2).json()["faces"]) == 2


def test_synthetic_held_out_faces_through_http_match_the_exported_model(url):
    faces = [render_face(sample_rng(1, i), 112, label=i % 7) for i in range(140)]  # the demo's held-out seed
    session = ort.InferenceSession(ROOT / "model_repository" / "expression-vit" / "model.onnx",
                                   providers=["CPUExecutionProvider"])
    direct = session.run(["logits"], graph_inputs(np.stack([np.asarray(f.image) for f in faces])))[0].argmax(1)
    labels = json.loads((ROOT / "model_repository" / "expression-vit" / "manifest.json").read_text())["labels"]
    via_http = []
    for f in faces:
        (face,) = post(url, encode(f.image, "PNG"), detect="false").json()["faces"]
        via_http.append(labels.index(face["expression"]))
    truth = np.array([f.label for f in faces])
    assert np.array_equal(np.array(via_http), direct)
    assert (direct == truth).mean() >= 0.95


def test_face_attention_maps_and_wrong_models(url):
    (face,) = post(url, photo_bytes("astronaut", "JPEG"), attention="true").json()["faces"]
    body = httpx.get(f"{url}{face['attention_map_url']}&format=json").json()
    side = round(max(face["box"][2:]) * 1.4)  # the face region with its 20% margins, at the photo's resolution
    assert body["image_size"] == [side, side] and body["grid_size"] == [7, 7]
    r = post(url, photo_bytes("astronaut", "JPEG"), model="shapes-vit")
    assert r.status_code == 400 and r.json()["error"]["code"] == "not_an_expression_model"
    assert post(url, b"not an image").status_code == 415
