"""Relevance maps served (method=relevance): the map of the label asked for, equal to the relevance graph's, batched
across requests with a target per row, and every hostile case a 4xx with a clear JSON error.

The graphs' own fidelity to autograd is tests/test_relevance.py's; their faithfulness (two shapes, one per half) is
checked here on the embedded models, and reported by bench/relevance.py."""
import asyncio
import io
import sys

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from PIL import Image
from service_process import ROOT, direct_probabilities

from models.synthetic import sample_rng
from models.synthetic.shapes import LABELS, two_shapes
from repository import read_entry
from service.core.metrics import Metrics
from service.core.settings import Settings
from service.engine.backends.local import LocalBackend
from service.explain.maps import relevance_grid
from service.http.app import create_app

sys.path.insert(0, str(ROOT / "bench"))
from relevance import Graphs, two_shape_pass_rate  # noqa: E402  (the benchmark's own measure)

REPO = ROOT / "model_repository"


def two_shape_image(index: int) -> tuple[np.ndarray, tuple[int, int]]:
    image, labels, _ = two_shapes(sample_rng(31337, index))
    return np.asarray(image), labels


def png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def graph_map(name: str, pixels: np.ndarray, index: int | None) -> np.ndarray:
    """The relevance graph's map, run directly, drawn as the service draws it (token cls)."""
    entry = read_entry(REPO / name)
    target = np.zeros((1, len(entry.labels)), np.float32)
    if index is not None:
        target[0, index] = 1
    session = ort.InferenceSession(str(entry.path("relevance")), providers=["CPUExecutionProvider"])
    _, rows = session.run(None, {"images": pixels[None], "target": target})
    return relevance_grid(rows[0], entry.manifest["relevance"], "cls")


@pytest.fixture(scope="module")
def answers():
    """One app in this process (the real LocalBackend) answering every request below, concurrently."""
    pixels, (first, second) = two_shape_image(0)
    image = png(pixels)
    face = png(np.asarray(Image.open(io.BytesIO(png(pixels))).resize((64, 64))))

    def post(model: str, **params) -> tuple:
        return ("POST", "/attention-map", {"files": {"file": ("two.png", image)},
                                           "params": {"model": model, "format": "json", **params}})

    def v2(model: str, *tensors: tuple) -> tuple:
        inputs = [{"name": n, "datatype": d, "shape": list(np.shape(v)), "data": np.ravel(v).tolist()}
                  for n, d, v in tensors]
        return ("POST", f"/v2/models/{model}/infer", {"json": {"inputs": inputs}})

    one = ("images", "UINT8", pixels[None])
    requests = {
        "first": post("shapes-vit", method="relevance", label=LABELS[first]),
        "second": post("shapes-vit", method="relevance", label=LABELS[second]),
        "second_by_class": post("shapes-vit", method="relevance", **{"class": second}),
        "top": post("shapes-vit", method="relevance"),
        "png": ("POST", "/attention-map", {"files": {"file": ("two.png", image)},
                                           "params": {"model": "shapes-deit", "method": "relevance", "token": "both",
                                                      "label": LABELS[first]}}),
        "dist": post("shapes-deit", method="relevance", token="dist", label=LABELS[second]),
        "swin": post("shapes-swin", method="relevance", label=LABELS[second]),
        "cam": ("POST", "/attention-map", {"files": {"file": ("face.png", face)},
                                           "params": {"model": "expression-fer2013", "format": "json",
                                                      "method": "relevance", "label": "happiness"}}),
        "classified": ("POST", "/classify", {"files": {"file": ("two.png", image)},
                                             "params": {"model": "shapes-swin", "attention": "true"}}),
        "expressed": ("POST", "/expression", {"files": {"file": ("face.png", face)},
                                              "params": {"model": "expression-fer2013", "attention": "true",
                                                         "detect": "false"}}),
        # hostile
        "unknown_label": post("shapes-vit", method="relevance", label="unicorn"),
        "other_models_label": post("shapes-vit", method="relevance", label="happiness"),
        "class_past_the_end": post("shapes-vit", method="relevance", **{"class": 6}),
        "class_negative": post("shapes-vit", method="relevance", **{"class": -1}),
        "class_huge": post("shapes-vit", method="relevance", **{"class": 10**30}),
        "class_not_a_number": post("shapes-vit", method="relevance", **{"class": "star"}),
        "label_and_class": post("shapes-vit", method="relevance", label="star", **{"class": 3}),
        "label_without_relevance": post("shapes-vit", label="star"),
        "head_with_relevance": post("shapes-vit", method="relevance", head="0"),
        "label_too_long": post("shapes-vit", method="relevance", label="x" * 300),
        "no_relevance_graph": post("shapes-vit-int8", method="relevance"),
        "unknown_method": post("shapes-vit", method="gradients"),
        "cnn_last": ("POST", "/attention-map", {"files": {"file": ("face.png", face)},
                                                "params": {"model": "expression-fer2013", "method": "last"}}),
        "bad_file": ("POST", "/attention-map", {"files": {"file": ("x.png", b"not an image")},
                                                "params": {"model": "shapes-vit", "method": "relevance",
                                                           "label": "star"}}),
        "missing_id": ("GET", "/attention-map", {"params": {"id": "0" * 32, "method": "relevance"}}),
        "models": ("GET", "/models", {}),
        "v2_target_beside_pixels": v2("shapes-vit", one, ("pixel_values", "FP32", np.zeros((1, 3, 96, 96))),
                                      ("target", "FP32", np.zeros((2, 6)))),
        "v2_target_rows_not_images": v2("shapes-vit", one, ("target", "FP32", np.zeros((2, 6)))),
        "v2_target_not_finite": v2("shapes-vit", one, ("target", "FP32", [[1e39] * 6])),
        "v2_target_uint8": v2("shapes-vit", one, ("target", "UINT8", np.zeros((1, 6)))),
        "v2_target_without_graph": v2("shapes-vit-int8", one, ("target", "FP32", np.zeros((1, 6)))),
    }
    settings = Settings(model_repository=REPO, warmup_runs=0)
    app = create_app(settings, LocalBackend(settings, Metrics()), metrics=Metrics())

    def by_id(got: dict) -> dict:
        """Maps of the results those requests kept, by id (asked in the same app's life, after them)."""
        swin_id = got["classified"].json()["results"][0]["id"]
        face_id = got["expressed"].json()["faces"][0]["id"]
        return {"by_id": ("GET", "/attention-map", {"params": {"id": swin_id, "method": "relevance", "format": "json",
                                                               "label": LABELS[first]}}),
                "face_by_id": ("GET", "/attention-map", {"params": {"id": face_id, "method": "relevance",
                                                                    "format": "json", "label": "surprise"}}),
                "face_by_id_last": ("GET", "/attention-map", {"params": {"id": face_id}})}

    got = asyncio.run(call_twice(app, requests, by_id))
    return {"pixels": pixels, "labels": (first, second), **got}


async def call_twice(app, first: dict, then) -> dict:
    """The named requests through the app, concurrently, then those `then` makes of their answers, in one life of
    the app."""
    async with app.router.lifespan_context(app):
        await app.state.pipelines.backend.loaded()
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://vitserve") as client:
            async def send(named: dict) -> dict:
                answers = await asyncio.gather(*(client.request(m, p, **kw) for m, p, kw in named.values()))
                return dict(zip(named, answers))

            got = await send(first)
            return {**got, **await send(then(got))}


def test_the_map_of_each_label_is_the_relevance_graphs(answers):
    first, second = answers["labels"]
    for key, index in (("first", first), ("second", second), ("second_by_class", second)):
        body = answers[key].json()
        assert answers[key].status_code == 200, body
        assert (body["method"], body["rule"], body["label"], body["class"]) == ("relevance", "chefer2021",
                                                                                LABELS[index], index)
        assert body["head"] is None and body["token"] == "cls"
        np.testing.assert_allclose(body["grid"], graph_map("shapes-vit", answers["pixels"], index), atol=1e-4)
        probs = direct_probabilities(REPO / "shapes-vit", png(answers["pixels"]))
        assert body["score"] == pytest.approx(probs[index], abs=1e-5)
    assert answers["first"].json()["grid"] != answers["second"].json()["grid"]
    top = answers["top"].json()
    assert top["class"] == int(np.argmax(direct_probabilities(REPO / "shapes-vit", png(answers["pixels"]))))
    assert top["grid"] == answers["first" if top["class"] == first else "second"].json()["grid"] or \
        top["class"] not in (first, second)
    assert top["prediction"]["label"] == top["label"]  # the top label is the prediction's


def test_every_family_has_its_rule_and_a_png(answers):
    first, second = answers["labels"]
    picture = answers["png"]
    assert picture.status_code == 200 and picture.headers["content-type"] == "image/png"
    assert picture.headers["x-relevance"].startswith(f"{LABELS[first]} ")
    assert Image.open(io.BytesIO(picture.content)).size == (96, 96)
    dist = answers["dist"].json()
    assert (dist["rule"], dist["token"], dist["grid_size"]) == ("chefer2021", "dist", [12, 12])
    swin = answers["swin"].json()
    assert (swin["rule"], swin["token"], swin["grid_size"], swin["label"]) == ("gradcam", None, [6, 6],
                                                                              LABELS[second])
    cam = answers["cam"].json()
    assert answers["cam"].status_code == 200, cam
    assert (cam["rule"], cam["grid_size"], cam["label"]) == ("cam", [4, 4], "happiness")
    listed = {m["name"]: m["relevance"] for m in answers["models"].json()["models"]}
    assert {name: r and r["rule"] for name, r in listed.items()} == {
        "shapes-vit": "chefer2021", "shapes-deit": "chefer2021", "shapes-swin": "gradcam",
        "expression-vit": "chefer2021", "expression-fer2013": "cam", "shapes-vit-int8": None, "shapes-clip": None}


def test_maps_of_kept_results_by_id_take_a_label_too(answers):
    first, _ = answers["labels"]
    kept = answers["by_id"].json()
    assert answers["by_id"].status_code == 200, kept
    assert (kept["model"], kept["label"], kept["rule"]) == ("shapes-swin", LABELS[first], "gradcam")
    np.testing.assert_allclose(kept["grid"], graph_map("shapes-swin", answers["pixels"], first), atol=1e-4)
    face = answers["face_by_id"].json()
    assert answers["face_by_id"].status_code == 200, face
    assert (face["model"], face["label"], face["rule"]) == ("expression-fer2013", "surprise", "cam")
    # a CNN's kept face has no attention map, and says which map it has
    last = answers["face_by_id_last"]
    assert last.status_code == 400 and last.json()["error"]["code"] == "no_attention"
    assert "method=relevance" in last.json()["error"]["message"]


@pytest.mark.parametrize("key, status, code, says", [
    ("unknown_label", 400, "bad_label", "its labels: circle, square, triangle, star, cross, heart"),
    ("other_models_label", 400, "bad_label", "'happiness' is not a label of this model"),
    ("class_past_the_end", 400, "bad_class", "0 to 5"),
    ("class_negative", 400, "bad_class", "0 to 5"),
    ("class_huge", 400, "bad_class", "0 to 5"),
    ("class_not_a_number", 422, "invalid_request", "class"),
    ("label_and_class", 400, "bad_label", "not both"),
    ("label_without_relevance", 400, "bad_label", "method=relevance"),
    ("head_with_relevance", 400, "bad_head", "combines the heads"),
    ("label_too_long", 422, "invalid_request", "label"),
    ("no_relevance_graph", 400, "relevance_unavailable", "export it again"),
    ("unknown_method", 422, "invalid_request", "method"),
    ("cnn_last", 400, "no_attention", "method=relevance"),
    ("bad_file", 415, "unsupported_media_type", "not an image"),
    ("missing_id", 404, "attention_not_found", "expired"),
    ("v2_target_beside_pixels", 400, None, "no `pixel_values`"),
    ("v2_target_rows_not_images", 400, None, "a row of 'target' each"),
    ("v2_target_not_finite", 400, None, "not finite"),
    ("v2_target_uint8", 400, None, "FP32 [-1, 6]"),
    ("v2_target_without_graph", 400, None, "this model takes 'images' UINT8"),
])
def test_hostile_requests_get_a_clear_4xx(answers, key, status, code, says):
    error = answers[key].json()["error"]  # /v2's is its message alone, as KServe's protocol has it
    got, message = (error["code"], error["message"]) if isinstance(error, dict) else (None, error)
    assert (answers[key].status_code, got) == (status, code), error
    assert says in message


def test_maps_of_several_requests_run_as_one_batch_each_as_if_alone():
    """Relevance requests queued together run as one batch, each image with its own target (a row of the target
    input), and each answer is the one it gets alone."""
    images = np.stack([two_shape_image(i)[0] for i in range(6)])
    targets = np.zeros((6, len(LABELS)), np.float32)
    targets[np.arange(1, 6), np.arange(1, 6)] = 1  # the first: its top label; the others: a label each

    async def run() -> tuple[list, list, int]:
        backend = LocalBackend(Settings(model_repository=REPO, warmup_runs=0), Metrics())
        await backend.start()
        await backend.loaded()
        try:
            def maps(i: int):
                return backend.side("shapes-deit", "relevance", {"image": images[i:i + 1], "target": targets[i:i + 1]})

            together = await asyncio.gather(*(maps(i) for i in range(6)))
            batches = backend.side_batchers["shapes-deit", "relevance"].finished
            alone = [await maps(i) for i in range(6)]
            return together, alone, batches
        finally:
            await backend.close()

    together, alone, batches = asyncio.run(run())
    assert batches == 1
    for out, out_alone in zip(together, alone):
        np.testing.assert_allclose(out["logits"], out_alone["logits"], atol=1e-5)
        np.testing.assert_allclose(out["relevance"], out_alone["relevance"],
                                   atol=1e-6 * float(np.abs(out_alone["relevance"]).max()))
    assert len({out["relevance"].tobytes() for out in together}) == 6


# the share of (image, label) pairs each model's maps hold at least: measured 89% (ViT), 90% (DeiT) and 94% (Swin) on
# these 100 pairs, 90.5%, 90.2% and 91.5% on bench/relevance.py's 400 (docs/attention.md#why-this-label)
FAITHFUL = {"shapes-vit": 0.85, "shapes-deit": 0.85, "shapes-swin": 0.9}


@pytest.mark.parametrize("name", FAITHFUL)
def test_each_labels_map_finds_its_own_shape(name):
    """Two shapes of two classes, one in each half: the map of each label puts more of its mass on that label's shape
    than on the other, for most (image, label) pairs. The last block's map, the same for both labels, cannot pass for
    more than about half."""
    graphs = Graphs(REPO / name)
    assert two_shape_pass_rate(graphs, "relevance", 50) >= FAITHFUL[name]
    assert two_shape_pass_rate(graphs, "last", 50) <= 0.6
