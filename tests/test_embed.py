"""POST /embed end to end: the real server on a loopback port, the embedded model repository (re-exported with the
`embeddings` output), real photographs and the demo models' own held-out images. The vectors are the graph's own,
normalised or not, as JSON or base64; over /v2 they are an output like any other; and they mean something: a
held-out shape's nearest neighbour is of its own class."""
import base64
import io
import json

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from service_process import ROOT, model_pixels, photo_bytes, run_graph, running_service

from models.synthetic.shapes import shapes

REPO = ROOT / "model_repository"
JPEG, PNG = photo_bytes("chelsea", "JPEG"), photo_bytes("astronaut", "PNG")
TRANSFORMERS = ("shapes-vit", "shapes-deit", "shapes-swin", "expression-vit")


AVIF_BOMB = (ROOT / "tests" / "reference" / "flat_12000.avif").read_bytes()  # 144 MP, its header says 64 x 64


@pytest.fixture(scope="module")
def url():
    with running_service(max_queue_delay_ms=10, response_cache_bytes=10_000_000) as base:
        yield base


@pytest.fixture(scope="module")
def process_url():
    with running_service(backend="process", workers=1) as base:
        yield base


def embed(url: str, *uploads: tuple[str, bytes], field: str = "file", **params) -> httpx.Response:
    files = [(field, (name, data)) for name, data in uploads]
    return httpx.post(f"{url}/embed", files=files, params=params, timeout=60)


def direct(model: str, *images: bytes) -> np.ndarray:
    """The model's graph on the service's own preprocessing, its `embeddings` output, by a plain ORT session."""
    names = [o["name"] for o in json.loads((REPO / model / "manifest.json").read_text())["outputs"]]
    x = np.stack([model_pixels(REPO / model, image) for image in images])
    return run_graph(REPO / model / "model.onnx", x)[names.index("embeddings")]


@pytest.mark.parametrize("model", TRANSFORMERS)
def test_an_embedding_is_the_graphs_own_normalised_or_not_as_json_or_base64(url, model):
    want = direct(model, JPEG, PNG)
    manifest = json.loads((REPO / model / "manifest.json").read_text())
    assert manifest["embedding"]["size"] == want.shape[1] and manifest["embedding"]["output"] == "embeddings"
    raw = embed(url, ("a.jpg", JPEG), ("b.png", PNG), field="files", model=model, normalize="false")
    assert raw.status_code == 200, raw.text
    body = raw.json()
    assert (body["model"], body["size"], body["normalized"], body["encoding"]) == (model, want.shape[1], False, "json")
    assert body["pooling"] == manifest["embedding"]["pooling"]
    assert [r["index"] for r in body["results"]] == [0, 1] and [r["filename"] for r in body["results"]] == ["a.jpg",
                                                                                                          "b.png"]
    got = np.array([r["embedding"] for r in body["results"]], np.float32)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    unit = embed(url, ("a.jpg", JPEG), ("b.png", PNG), field="files", model=model, encoding="base64").json()
    vectors = np.stack([np.frombuffer(base64.b64decode(r["embedding"]), "<f4") for r in unit["results"]])
    assert unit["normalized"] is True and unit["encoding"] == "base64" and vectors.shape == want.shape
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-6)
    np.testing.assert_allclose(vectors, want / np.linalg.norm(want, axis=1, keepdims=True), atol=1e-6)
    assert not np.allclose(vectors[0], vectors[1], atol=1e-2)  # two photos, two vectors


def test_classify_answers_as_before_beside_the_new_output(url):
    """The logits are unchanged by the graph's new output: /classify's scores are the direct session's."""
    body = httpx.post(f"{url}/classify", files={"file": ("a.jpg", JPEG)}, params={"model": "shapes-deit", "top_k": 6},
                      timeout=30).json()
    logits = run_graph(REPO / "shapes-deit" / "model.onnx", model_pixels(REPO / "shapes-deit", JPEG)[None])[0][0]
    probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    got = {p["index"]: p["score"] for p in body["results"][0]["predictions"]}
    np.testing.assert_allclose([got[i] for i in range(6)], probs, atol=1e-5)


@pytest.mark.parametrize("model", ("shapes-vit", "shapes-deit", "shapes-swin"))
def test_a_held_out_shapes_nearest_neighbour_is_mostly_of_its_own_class(url, model):
    """The demo models' held-out images (seed 1, what `make models` scores them on), 20 of each class: each one's
    nearest other image by cosine shares its label for at least 90% of them."""
    samples = shapes(seed=1, count=120)
    vectors = []
    for first in range(0, len(samples), 60):
        files = []
        for i, sample in enumerate(samples[first:first + 60]):
            buffer = io.BytesIO()
            sample.image.save(buffer, format="PNG")
            files.append((f"{first + i}.png", buffer.getvalue()))
        answer = embed(url, *files, field="files", model=model, encoding="base64")
        assert answer.status_code == 200, answer.text
        vectors += [np.frombuffer(base64.b64decode(r["embedding"]), "<f4") for r in answer.json()["results"]]
    v = np.stack(vectors)
    similarity = v @ v.T
    np.fill_diagonal(similarity, -np.inf)
    labels = np.array([s.label for s in samples])
    agreement = float((labels[similarity.argmax(1)] == labels).mean())
    assert agreement >= 0.9, agreement


def test_embeddings_are_an_output_a_v2_client_asks_for_in_binary_too(url):
    client = triton.InferenceServerClient(url=url.removeprefix("http://"))
    x = model_pixels(REPO / "shapes-swin", JPEG)[None]
    inp = triton.InferInput("images", list(x.shape), "UINT8")
    inp.set_data_from_numpy(x, binary_data=True)
    for binary in (True, False):
        result = client.infer("shapes-swin", [inp], outputs=[triton.InferRequestedOutput("embeddings",
                                                                                         binary_data=binary)])
        np.testing.assert_allclose(result.as_numpy("embeddings"), direct("shapes-swin", JPEG), atol=1e-5)
        assert result.as_numpy("logits") is None  # only what was asked for
    meta = client.get_model_metadata("shapes-swin")
    assert {"name": "embeddings", "datatype": "FP32", "shape": [-1, 192]} in meta["outputs"]


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_bad_input_gets_classifys_answers_and_the_server_keeps_serving(url, process_url, backend):
    url = url if backend == "thread" else process_url
    cut, text = JPEG[: len(JPEG) // 3], b"just text"
    r = embed(url, ("a.jpg", JPEG), ("cut.jpg", cut), ("notes.txt", text), ("bomb.avif", AVIF_BOMB), field="files",
              model="shapes-vit")
    assert r.status_code == 200, r.text
    good, bad, notes, bomb = r.json()["results"]
    assert good["index"] == 0 and len(good["embedding"]) == 128
    assert bad == {"index": 1, "filename": "cut.jpg", "error": bad["error"]} and bad["error"]["code"] == "bad_image"
    assert notes["error"]["code"] == "unsupported_media_type" and "embedding" not in notes
    assert bomb["error"]["code"] == "image_too_large"
    alone = {"cut": embed(url, ("cut.jpg", cut)), "text": embed(url, ("notes.txt", text)),
             "bomb": embed(url, ("bomb.avif", AVIF_BOMB)),
             "none": httpx.post(f"{url}/embed", timeout=30),
             "many": embed(url, *[("a.jpg", JPEG)] * 65, field="files")}
    assert (alone["cut"].status_code, alone["cut"].json()["error"]["code"]) == (400, "bad_image")
    assert (alone["text"].status_code, alone["text"].json()["error"]["code"]) == (415, "unsupported_media_type")
    assert (alone["none"].status_code, alone["none"].json()["error"]["code"]) == (400, "no_image")
    assert (alone["many"].status_code, alone["many"].json()["error"]["code"]) == (413, "too_many_files")
    assert (alone["bomb"].status_code, alone["bomb"].json()["error"]["code"]) == (413, "image_too_large")
    for params in ({"encoding": "float16"}, {"normalize": "maybe"}, {"timeout_ms": 0}, {"timeout_ms": 10**10},
                   {"priority": -1}, {"priority": 101}):
        refused = embed(url, ("a.jpg", JPEG), **params)
        assert refused.status_code == 422 and "error" in refused.json(), (params, refused.text)
    r = embed(url, ("a.jpg", JPEG), model="expression-fer2013")  # a CNN: no embedding output
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_embedding" and "embedding" in r.text
    assert embed(url, ("a.jpg", JPEG), model="nope").status_code == 404
    assert embed(url, ("a.jpg", JPEG), priority=1, timeout_ms=60_000).status_code == 200


def test_the_response_cache_answers_a_repeat_and_a_bad_file_beside_it_fails_alone(url):
    photo = photo_bytes("coffee", "JPEG", quality=83)  # an upload no other test sends
    first = embed(url, ("c.jpg", photo), model="shapes-deit", normalize="false").json()["results"][0]
    again = embed(url, ("c.jpg", photo), ("cut.jpg", photo[:500]), field="files", model="shapes-deit",
                  normalize="false").json()["results"]
    assert first["batch_size"] >= 1 and again[0]["batch_size"] == 0 and again[0]["embedding"] == first["embedding"]
    assert again[1]["error"]["code"] == "bad_image"
    classified = httpx.post(f"{url}/classify", files={"file": ("c.jpg", photo)}, params={"model": "shapes-deit"},
                            timeout=30).json()["results"][0]
    assert classified["batch_size"] >= 1 and classified["predictions"]  # /classify's answers are kept apart
    models = {m["name"]: m for m in httpx.get(f"{url}/models", timeout=10).json()["models"]}
    assert models["shapes-deit"]["embedding"]["size"] == 128 and models["expression-fer2013"]["embedding"] is None
