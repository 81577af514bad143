"""POST /expression end to end: real photographs, a collage of real faces, faces turned in-plane, and the synthetic
held-out faces; the default model (expression-fer2013, a CNN with real weights) and the cartoon-face ViT beside it."""
import io
import json
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image
from service_process import ROOT, metric, photo_bytes, role_pids, running_service, service_and_process
from skimage import data as photos

from face_scenes import ASTRONAUT_FACE, astronaut_face, astronaut_five_times, found, group_photo, paste

from models.labels import RAF_DB_LABELS
from models.synthetic import sample_rng
from models.synthetic.faces import render_face
from repository import graph_inputs

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


def test_astronaut_has_one_face_where_it_is_with_its_landmarks(url):
    r = post(url, photo_bytes("astronaut", "JPEG"))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "expression-fer2013" and body["image_size"] == [512, 512]
    (face,) = body["faces"]
    # MTCNN's box runs brow to chin, taller than the Haar cascade's square: 0.77 IoU (bench/face_detection.py)
    assert iou(face["box"], ASTRONAUT_FACE) >= 0.7 and face["detection_score"] > 0.99
    marks = face["landmarks"]
    x, y, w, h = ASTRONAUT_FACE
    assert list(marks) == ["left_eye", "right_eye", "nose", "mouth_left", "mouth_right"]
    assert all(x <= px <= x + w and y <= py <= y + h for px, py in marks.values())
    assert marks["left_eye"][0] < marks["nose"][0] < marks["right_eye"][0]
    assert max(marks["left_eye"][1], marks["right_eye"][1]) < marks["nose"][1] < marks["mouth_left"][1]
    labels = json.loads((ROOT / "model_repository" / "expression-fer2013" / "manifest.json").read_text())["labels"]
    assert list(face["probabilities"]) == labels == ["anger", "disgust", "fear", "happiness", "sadness", "surprise",
                                                     "neutral"]
    assert abs(sum(face["probabilities"].values()) - 1) < 1e-6
    assert face["expression"] == max(face["probabilities"], key=face["probabilities"].get) == "happiness"
    assert face["score"] > 0.9  # she smiles
    vit = post(url, photo_bytes("astronaut", "JPEG"), model="expression-vit").json()
    assert vit["model"] == "expression-vit" and vit["faces"][0]["box"] == face["box"]
    assert list(vit["faces"][0]["probabilities"]) == list(RAF_DB_LABELS)


def test_several_photos_are_answered_each_in_order_and_one_that_cannot_be_read_gets_its_own_error(url):
    astronaut, group = photo_bytes("astronaut", "JPEG"), encode(group_photo((0,))[0])
    alone = post(url, astronaut).json()["faces"]
    files = [("files", ("astronaut.jpg", astronaut)), ("files", ("cut.jpg", astronaut[:len(astronaut) // 3])),
             ("files", ("group.jpg", group)), ("files", ("notes.txt", b"no photo"))]
    r = httpx.post(f"{url}/expression", files=files, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "expression-fer2013" and [x["filename"] for x in body["results"]] == [
        "astronaut.jpg", "cut.jpg", "group.jpg", "notes.txt"]
    her, cut, team, notes = body["results"]
    assert [f["box"] for f in her["faces"]] == [f["box"] for f in alone] and her["image_size"] == [512, 512]
    assert her["faces"][0]["expression"] == alone[0]["expression"] == "happiness"
    assert cut["error"]["code"] == "bad_image" and notes["error"]["code"] == "unsupported_media_type"
    assert len(team["faces"]) >= 2 and "error" not in team
    # none readable: the request's error; two photos as 'file': refused, as before
    bad = httpx.post(f"{url}/expression", files=files[1:2] + files[3:], timeout=60)
    assert bad.status_code in (400, 415) and bad.json()["error"]["code"] in ("bad_image", "unsupported_media_type")
    twice = httpx.post(f"{url}/expression", files=[("file", ("a.jpg", astronaut)), ("file", ("b.jpg", astronaut))],
                       timeout=60)
    assert twice.status_code == 400 and twice.json()["error"]["code"] == "one_image"


def test_her_mirrored_face_and_her_face_five_times_turned_and_smaller_smile_too(url):
    mirrored = Image.fromarray(photos.astronaut()).transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    (face,) = post(url, encode(mirrored, quality=92)).json()["faces"]
    assert face["expression"] == "happiness" and face["score"] > 0.9
    scene, pasted = astronaut_five_times()
    faces = post(url, encode(scene, quality=95)).json()["faces"]
    boxes = np.array([[x, y, x + w, y + h] for x, y, w, h in (f["box"] for f in faces)], np.float64)
    assert len(faces) == 5 and all(found(boxes, p) for p in pasted)
    assert [f["expression"] for f in faces] == ["happiness"] * 5, faces


def test_faces_turned_30_degrees_either_way_are_found_in_a_group_photo(url):
    scene, faces = group_photo(angles=(-30, 30))
    got = post(url, encode(scene, quality=95)).json()["faces"]
    boxes = np.array([[x, y, x + w, y + h] for x, y, w, h in (f["box"] for f in got)], np.float64)
    assert sum(found(boxes, face) for face in faces) >= 8  # of 10; OpenCV's Haar cascade found 1
    assert len(got) == len({f["id"] for f in got}) and all(any(found(b[None], f) for f in faces) for b in boxes)


def test_a_large_jpeg_decodes_reduced_and_its_faces_come_back_in_its_own_pixels(url):
    big = Image.fromarray(photos.astronaut()).resize((2048, 2048), Image.BICUBIC)  # decoded at 1024: draft 1/2
    body = post(url, encode(big, quality=90)).json()
    (face,) = body["faces"]
    x, y, w, h = (4 * v for v in ASTRONAUT_FACE)
    assert body["image_size"] == [2048, 2048] and iou(face["box"], (x, y, w, h)) >= 0.7
    assert all(x <= px <= x + w and y <= py <= y + h for px, py in face["landmarks"].values())


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
    five = {"model": "expression-fer2013", "le": "8.0"}
    four = {"model": "expression-fer2013", "le": "4.0"}
    grew = lambda labels: (metric(after, "vitserve_batch_size_bucket", **labels)  # noqa: E731
                           - metric(before, "vitserve_batch_size_bucket", **labels))
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
        (face,) = post(url, encode(f.image, "PNG"), detect="false", model="expression-vit").json()["faces"]
        via_http.append(labels.index(face["expression"]))
    truth = np.array([f.label for f in faces])
    assert np.array_equal(np.array(via_http), direct)
    assert (direct == truth).mean() >= 0.95


def test_face_attention_maps_and_wrong_models(url):
    (face,) = post(url, photo_bytes("astronaut", "JPEG"), attention="true", model="expression-vit").json()["faces"]
    body = httpx.get(f"{url}{face['attention_map_url']}&format=json").json()
    assert body["image_size"] == [112, 112] and body["grid_size"] == [7, 7]  # over the aligned face the model saw
    r = post(url, photo_bytes("astronaut", "JPEG"), model="shapes-vit")
    assert r.status_code == 400 and r.json()["error"]["code"] == "not_an_expression_model"
    assert post(url, b"not an image").status_code == 415


def test_the_cnn_has_no_attention_maps_but_its_relevance_map_on_every_route(url):
    """expression-fer2013 has no attention outputs: its last and rollout maps are 400 no_attention before any work,
    saying its relevance map (CAM) is there, and the server serves on; attention=true keeps its faces for that map;
    /models and the v2 metadata say so."""
    photo = photo_bytes("astronaut", "JPEG")
    files = {"file": ("photo", photo)}
    kept = [post(url, photo, attention="true").json()["faces"][0]["attention_map_url"],
            httpx.post(f"{url}/classify", files=files, params={"model": "expression-fer2013", "attention": "true"}
                       ).json()["results"][0]["attention_map_url"]]
    refused = [httpx.post(f"{url}/attention-map", files=files, params={"model": "expression-fer2013"}),
               *(httpx.get(f"{url}{path}&method=rollout") for path in kept)]
    for r in refused:
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_attention", r.text
        assert "expression-fer2013 has no attention" in r.json()["error"]["message"]
        assert "method=relevance" in r.json()["error"]["message"]
    for path in kept:
        why = httpx.get(f"{url}{path}&method=relevance&label=happiness&format=json")
        assert why.status_code == 200 and (why.json()["rule"], why.json()["grid_size"]) == ("cam", [4, 4]), why.text
    pixels = np.zeros((1, 64, 64, 3), np.uint8)
    v2 = httpx.post(f"{url}/v2/models/expression-fer2013/infer", json={
        "inputs": [{"name": "images", "datatype": "UINT8", "shape": list(pixels.shape),
                    "data": pixels.ravel().tolist()}],
        "outputs": [{"name": "cls_attention"}]})
    assert v2.status_code == 400 and "has no attention outputs" in v2.json()["error"], v2.text
    served = httpx.post(f"{url}/classify", files=files, params={"model": "expression-fer2013"})
    assert served.status_code == 200 and served.json()["results"][0]["attention_map_url"] is None  # (not asked for)
    models = {m["name"]: m for m in httpx.get(f"{url}/models").json()["models"]}
    assert models["expression-fer2013"]["attention"] is None and not models["expression-fer2013"]["explain"]
    assert models["expression-fer2013"]["family"] == "cnn" and models["expression-vit"]["attention"] is not None
    meta = httpx.get(f"{url}/v2/models/expression-fer2013").json()
    assert meta["parameters"]["attention_outputs"] == [] and [o["name"] for o in meta["outputs"]] == ["logits"]
    assert httpx.get(f"{url}/v2/models/expression-vit").json()["parameters"]["attention_outputs"] == ["cls_attention"]


def test_the_process_backend_finds_the_same_faces_in_its_workers(url):
    """Each HTTP worker opens the detector: the same boxes, landmarks and probabilities as the thread backend,
    and a face's attention map kept in the inference process."""
    group = encode(group_photo(angles=(0,))[0], quality=95)
    with running_service(backend="process", workers=2) as base:
        for photo in (photo_bytes("astronaut", "JPEG"), group):
            here = post(url, photo, model="expression-vit").json()["faces"]
            there = post(base, photo, attention="true", model="expression-vit").json()["faces"]
            assert [f["box"] for f in there] == [f["box"] for f in here] and len(here) >= 1
            for a, b in zip(here, there):
                assert a["landmarks"] == b["landmarks"]
                np.testing.assert_allclose(list(a["probabilities"].values()), list(b["probabilities"].values()),
                                           atol=1e-5)
            assert httpx.get(f"{base}{there[0]['attention_map_url']}").status_code == 200


def crowd_jpeg() -> bytes:
    """20 astronaut faces of 150 pixels over gravel, 1600 x 1200 (bench/crowd_memory.py's)."""
    scene = Image.fromarray(photos.gravel()).convert("RGB").resize((1600, 1200))
    for i in range(20):
        paste(scene, astronaut_face(), 160 + (i % 5) * 320, 150 + (i // 5) * 300, 150, 0)
    buf = io.BytesIO()
    scene.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def rss_mb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmRSS")).split()[1]) >> 10


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_the_memory_a_refused_crowd_took_goes_back(backend):
    """Requests of 20 crowd photos past the request's face budget (a 413 once 100 faces are found): the memory their
    decodes and detections took does not stay with the process that decoded them (the server, or its HTTP worker),
    as ONNX Runtime's arena and glibc's freed heap kept it (600 MB more after the first, on either backend)."""
    crowd = crowd_jpeg()
    with service_and_process(backend=backend, workers=1, face_request_max=100) as (url, process):
        pid = process.pid if backend == "thread" else role_pids(process.pid, "vitserve-http")[0]
        one = httpx.post(f"{url}/expression", files={"file": ("crowd.jpg", crowd)}, timeout=120)
        assert one.status_code == 200 and len(one.json()["faces"]) == 20, one.text
        before = rss_mb(pid)
        for _ in range(2):
            refused = httpx.post(f"{url}/expression", files=[("files", (f"{i}.jpg", crowd)) for i in range(20)],
                                 timeout=300)
            assert refused.status_code == 413 and refused.json()["error"]["code"] == "too_many_faces", refused.text
        grown = rss_mb(pid) - before
    assert grown < 150, f"{grown} MB more after the refused crowds"
