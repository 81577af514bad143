"""End to end: the real server on a loopback port, the embedded model repository, real photographs."""
import asyncio
import io
import json
import os
import re
import subprocess
import sys
import time

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton
from PIL import Image
from service_process import (ROOT, direct_probabilities, metric, model_pixels, photo_bytes, process_metrics,
                             running_service, write_model)

from skimage import data as photos

from repository import graph_inputs

REPO = ROOT / "model_repository"
JPEG, PNG = photo_bytes("chelsea", "JPEG"), photo_bytes("astronaut", "PNG")


@pytest.fixture(scope="module")
def url():
    with running_service(max_upload_bytes=2_000_000, max_queue_delay_ms=30) as base:
        yield base


def classify(url: str, *uploads: tuple[str, bytes], field: str = "file", **params) -> httpx.Response:
    files = [(field, (name, data)) for name, data in uploads]
    return httpx.post(f"{url}/classify", files=files, params=params, timeout=30)


def test_one_jpeg_and_one_png(url):
    default = httpx.get(f"{url}/models").json()["default_model"]
    for name, data in (("chelsea.jpg", JPEG), ("astronaut.png", PNG)):
        r = classify(url, (name, data), top_k=3)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == default
        (result,) = body["results"]
        assert result["filename"] == name and len(result["id"]) == 32
        scores = [p["score"] for p in result["predictions"]]
        assert len(scores) == 3 and scores == sorted(scores, reverse=True) and 0 < sum(scores) <= 1 + 1e-6
        labels = json.loads((REPO / default / "manifest.json").read_text())["labels"]
        assert all(labels[p["index"]] == p["label"] for p in result["predictions"])
        assert set(result["timings_ms"]) == {"decode_ms", "queue_ms", "inference_ms", "total_ms"}


def test_several_files_are_separate_items_of_one_batch(url):
    r = classify(url, ("a.jpg", JPEG), ("b.png", PNG), ("c.jpg", JPEG), field="files", top_k=1)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["filename"] for x in results] == ["a.jpg", "b.png", "c.jpg"]
    assert results[0]["predictions"] == results[2]["predictions"]  # the same photo, the same answer
    assert all(x["batch_size"] >= 3 for x in results)


def test_a_file_of_several_that_cannot_be_read_gets_its_own_error_and_the_others_their_answers(url):
    alone = classify(url, ("a.jpg", JPEG), top_k=2).json()["results"][0]["predictions"]
    for attention in ("false", "true"):  # the hot path (upload_input) and the one that keeps photos for maps
        r = classify(url, ("a.jpg", JPEG), ("cut.jpg", JPEG[: len(JPEG) // 3]), ("notes.txt", b"just text"),
                     ("c.png", PNG), field="files", top_k=2, attention=attention)
        assert r.status_code == 200, r.text
        a, cut, notes, c = r.json()["results"]
        assert a["filename"] == "a.jpg" and a["predictions"] == alone and c["filename"] == "c.png"
        assert cut["filename"] == "cut.jpg" and set(cut) == {"filename", "error"}
        assert cut["error"]["code"] == "bad_image" and "could not be decoded" in cut["error"]["message"]
        assert notes["error"]["code"] == "unsupported_media_type" and "predictions" not in notes
        assert (a["attention_map_url"] is not None) == (attention == "true")
        if attention == "true":
            assert httpx.get(url + c["attention_map_url"], timeout=30).status_code == 200
    every = classify(url, ("cut.jpg", JPEG[: len(JPEG) // 3]), ("notes.txt", b"just text"), field="files")
    assert every.status_code in (400, 415) and every.json()["error"]["code"] in ("bad_image", "unsupported_media_type")


def test_an_iphone_heic_and_an_avif_are_classified_as_their_jpeg_twin(url):
    """tests/reference/chelsea_iphone.heic: the photo stored turned, with the turn to show it upright in the file."""
    heic = (ROOT / "tests" / "reference" / "chelsea_iphone.heic").read_bytes()
    buf = io.BytesIO()
    Image.fromarray(photos.chelsea()).save(buf, "AVIF", quality=80)
    labels = len(json.loads((REPO / httpx.get(f"{url}/models").json()["default_model"] / "manifest.json")
                            .read_text())["labels"])
    by_label = lambda r: {p["label"]: p["score"] for p in r.json()["results"][0]["predictions"]}  # noqa: E731
    twin = by_label(classify(url, ("chelsea.jpg", JPEG), top_k=labels))
    for name, data in (("chelsea.heic", heic), ("chelsea.avif", buf.getvalue())):
        r = classify(url, (name, data), top_k=labels)
        assert r.status_code == 200, r.text
        scores = by_label(r)
        assert max(scores, key=scores.get) == max(twin, key=twin.get)
        assert max(abs(scores[k] - twin[k]) for k in twin) < 0.05, (name, scores, twin)


def test_scores_equal_a_direct_onnx_runtime_session(url):
    probs = direct_probabilities(REPO / "shapes-swin", JPEG)
    r = classify(url, ("chelsea.jpg", JPEG), model="shapes-swin", top_k=6)
    got = {p["index"]: p["score"] for p in r.json()["results"][0]["predictions"]}
    np.testing.assert_allclose([got[i] for i in range(6)], probs, atol=1e-5)


def test_top_k_bounds(url):
    assert len(classify(url, ("a.jpg", JPEG), top_k=100).json()["results"][0]["predictions"]) == 6  # all classes
    assert len(classify(url, ("a.jpg", JPEG), top_k=1).json()["results"][0]["predictions"]) == 1
    for bad in (0, 101, "many"):
        r = classify(url, ("a.jpg", JPEG), top_k=bad)
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
        assert "top_k" in r.json()["error"]["message"]


def test_bad_requests_get_clear_json_errors_and_the_server_keeps_serving(url):
    cases = [
        (classify(url, ("a.jpg", JPEG), model="no-such-model"), 404, "model_not_found", "no model named"),
        (classify(url, ("notes.txt", b"just some text")), 415, "unsupported_media_type", "not an image"),
        (classify(url, ("cut.jpg", JPEG[: len(JPEG) // 3])), 400, "bad_image", "could not be decoded"),
        (classify(url, ("big.png", b"\0" * 2_100_000)), 413, "too_large", "limit"),
        (httpx.post(f"{url}/classify", timeout=10), 400, "no_image", "multipart field 'file'"),
        (httpx.get(f"{url}/nowhere", timeout=10), 404, "not_found", "Not Found"),
    ]
    for response, status, code, words in cases:
        assert response.status_code == status, response.text
        assert response.json()["error"]["code"] == code and words in response.json()["error"]["message"]
    assert classify(url, ("a.jpg", JPEG)).status_code == 200


def test_an_upload_thirty_times_the_limit_gets_a_413_the_client_reads_and_is_never_held(url):
    rss = lambda: process_metrics(httpx.get(f"{url}/metrics").text)["process_resident_memory_bytes"]  # noqa: E731
    before, huge = rss(), os.urandom(60_000_000)
    sized = classify(url, ("huge.jpg", huge))  # Content-Length says it at once
    chunks = (huge[i:i + 2**20] for i in range(0, len(huge), 2**20))
    streamed = httpx.post(f"{url}/classify", content=chunks, timeout=60,  # chunked: found out while streaming
                          headers={"content-type": "multipart/form-data; boundary=x"})
    for response in (sized, streamed):
        assert response.status_code == 413 and response.json()["error"]["code"] == "too_large", response.text
    assert rss() - before < 20e6  # 60 MB went through twice; neither was kept
    assert classify(url, ("a.jpg", JPEG)).status_code == 200


def test_by_default_no_key_is_asked_and_no_page_elsewhere_may_call(url):
    r = httpx.get(f"{url}/models", headers={"Origin": "https://app.example"}, timeout=10)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_models_lists_every_model_with_provider_and_readiness(url):
    body = httpx.get(f"{url}/models").json()
    names = {m["name"]: m for m in body["models"]}
    assert {"shapes-vit", "shapes-vit-int8", "shapes-deit", "shapes-swin", "expression-vit"} <= set(names)
    assert body["default_model"] == "shapes-deit"  # the first classification model by name
    for m in names.values():
        assert m["ready"] and m["provider"] == "CPUExecutionProvider" and m["error"] is None
    assert names["shapes-vit-int8"]["precision"] == "int8" and names["expression-vit"]["task"] == "expression"
    assert names["shapes-deit"]["explain"] and not names["shapes-swin"]["explain"]
    assert names["expression-vit"]["preprocessing"]["interpolation"] == "bicubic"
    assert names["expression-vit"]["preprocessing"]["size"] == [112, 112]


def test_batches_form_under_concurrent_requests_and_metrics_move(url):
    before = httpx.get(f"{url}/metrics").text

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(f"{url}/classify", files={"file": ("a.jpg", JPEG)},
                                                      params={"model": "shapes-deit"}) for _ in range(24)))

    responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses)
    assert max(r.json()["results"][0]["batch_size"] for r in responses) > 1
    after = httpx.get(f"{url}/metrics").text
    model = {"model": "shapes-deit"}
    batches = metric(after, "vitserve_batch_size_count", **model) - metric(before, "vitserve_batch_size_count", **model)
    singles = (metric(after, "vitserve_batch_size_bucket", le="1.0", **model)
               - metric(before, "vitserve_batch_size_bucket", le="1.0", **model))
    assert 0 < batches < 24 and singles < batches  # fewer inference calls than images: batches > 1 formed
    images = metric(after, "vitserve_images_total", **model) - metric(before, "vitserve_images_total", **model)
    assert images == 24
    waits = (metric(after, "vitserve_queue_seconds_count", **model)
             - metric(before, "vitserve_queue_seconds_count", **model))
    assert waits == 24  # one per request
    requests = {"route": "/classify", "method": "POST", "status": "200"}
    assert (metric(after, "vitserve_requests_total", **requests)
            - metric(before, "vitserve_requests_total", **requests)) == 24
    assert metric(after, "vitserve_model_info", model="shapes-deit", version="1",
                  architecture="deit_micro_distilled_patch8_96", task="classification", precision="fp32",
                  provider="CPUExecutionProvider") == 1
    assert process_metrics(after)["process_cpu_seconds_total"] > process_metrics(before)["process_cpu_seconds_total"]
    assert process_metrics(after)["process_resident_memory_bytes"] > 50 * 2**20  # the sessions are in memory


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_round_trip_on_v2(url, binary):
    client = triton.InferenceServerClient(url=url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("shapes-deit")
    meta = client.get_model_metadata("shapes-deit")
    assert meta["inputs"] == [{"name": "images", "datatype": "UINT8", "shape": [-1, 96, 96, 3]}]
    assert meta["parameters"]["other_inputs"] == [{"name": "pixel_values", "datatype": "FP32",
                                                   "shape": [-1, 3, 96, 96]}]
    pre = meta["parameters"]["preprocessing"]  # what a client needs to make pixel_values from a photo
    assert pre["resize_short_side"] == 96 and pre["size"] == [96, 96] and len(pre["mean"]) == len(pre["std"]) == 3
    x = np.random.default_rng(0).standard_normal((3, 3, 96, 96)).astype(np.float32)
    inp = triton.InferInput("pixel_values", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    outputs = [triton.InferRequestedOutput("logits", binary_data=binary),
               triton.InferRequestedOutput("dist_attention", binary_data=not binary)]
    result = client.infer("shapes-deit", [inp], outputs=outputs)
    session = ort.InferenceSession(REPO / "shapes-deit" / "model.onnx", providers=["CPUExecutionProvider"])
    logits, _, dist, _ = session.run(None, graph_inputs(x))
    np.testing.assert_allclose(result.as_numpy("logits"), logits, atol=1e-5)
    np.testing.assert_allclose(result.as_numpy("dist_attention"), dist, atol=1e-6)
    assert client.infer("shapes-deit", [inp]).as_numpy("cls_attention").shape == (3, 4, 144)  # all outputs
    with pytest.raises(triton.InferenceServerException, match="no model 'nope'"):
        client.get_model_metadata("nope")


def test_v2_takes_uint8_images_too_and_answers_as_for_the_same_pixels_normalised(url):
    client = triton.InferenceServerClient(url=url.removeprefix("http://"))
    pixels = np.stack([model_pixels(REPO / "shapes-vit", photo_bytes(p, "JPEG")) for p in ("chelsea", "coffee")])
    images = triton.InferInput("images", list(pixels.shape), "UINT8")
    images.set_data_from_numpy(pixels)
    normalised = json.loads((REPO / "shapes-vit" / "manifest.json").read_text())["input"]
    x = ((pixels / 255 - normalised["mean"]) / normalised["std"]).transpose(0, 3, 1, 2).astype(np.float32)
    tensor = triton.InferInput("pixel_values", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    got = client.infer("shapes-vit", [images]).as_numpy("logits")
    np.testing.assert_allclose(got, client.infer("shapes-vit", [tensor]).as_numpy("logits"), atol=1e-5)
    assert got.shape == (2, 6)


def test_v2_rejects_malformed_tensors(url):
    bad = {"inputs": [{"name": "pixel_values", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 3072}]}
    r = httpx.post(f"{url}/v2/models/shapes-vit/infer", json=bad)
    assert r.status_code == 400 and "takes [-1, 3, 96, 96]" in r.json()["error"]  # the protocol's error shape
    bad["inputs"][0]["datatype"] = "INT64"
    r = httpx.post(f"{url}/v2/models/shapes-vit/infer", json=bad)
    takes = "'images' UINT8 [-1, 96, 96, 3] or 'pixel_values' FP32 [-1, 3, 96, 96]"
    assert r.status_code == 400 and takes in r.json()["error"]
    renamed = {"inputs": [{**bad["inputs"][0], "name": "input__0", "datatype": "FP32", "shape": [1, 3, 96, 96],
                           "data": [0.0] * 3 * 96 * 96}]}  # right shape and type, a name the model lacks
    r = httpx.post(f"{url}/v2/models/shapes-vit/infer", json=renamed)
    assert r.status_code == 400 and "'input__0' FP32" in r.json()["error"] and takes in r.json()["error"]


def test_openapi_docs_describe_the_routes_and_load_nothing_from_elsewhere(url):
    for page in ("/docs", "/redoc"):
        html = httpx.get(f"{url}{page}").text
        assets = re.findall(r'(?:src|href)="([^"]+)"', html) + re.findall(r"url: '([^']+)'", html)
        assert assets and all(a.startswith("/") for a in assets), assets  # no CDN: works offline
        assert all(httpx.get(f"{url}{a}").status_code == 200 for a in assets if a != "/openapi.json")
    spec = httpx.get(f"{url}/openapi.json").json()
    assert {"/classify", "/models", "/health/ready", "/v2/models/{name}/infer"} <= set(spec["paths"])
    assert "curl -F file=@cat.jpg" in spec["paths"]["/classify"]["post"]["description"]
    assert all(spec["components"]["schemas"][name]["examples"] for name in ("ClassifyResponse", "ExpressionResponse"))
    for path, operations in spec["paths"].items():  # no stray parameters: a route lists only what it takes
        for operation in operations.values():
            params = operation.get("parameters", [])
            assert {p["name"] for p in params if p["in"] == "path"} == set(re.findall(r"{(\w+)}", path)), path
            assert "version_" not in {p["name"] for p in params if p["in"] == "query"}, path


def test_readiness_waits_for_warm_up_and_more_images_than_the_queue_holds_get_413(tmp_path):
    write_model(tmp_path / "shapes-vit", REPO / "shapes-vit", "shapes-vit")  # one model's long warm-up is enough
    with running_service(model_repository=tmp_path, wait_ready=False, warmup_runs=60, queue_limit=2) as base:
        early = httpx.get(f"{base}/health/ready")
        assert early.status_code == 503 and early.headers["Retry-After"] == "1"
        assert early.json()["error"]["code"] == "not_ready"
        assert httpx.get(f"{base}/health/live").status_code == 200
        assert httpx.get(f"{base}/v2/health/ready").status_code == 400
        deadline = time.monotonic() + 120
        while httpx.get(f"{base}/health/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        # no retry could ever fit it (a full queue's 503: test_overload.py, test_process_backend.py)
        never = classify(base, ("a.jpg", JPEG), ("b.jpg", JPEG), ("c.jpg", JPEG), field="files")
        assert never.status_code == 413 and "Retry-After" not in never.headers
        error = never.json()["error"]
        assert error["code"] == "too_many_images" and "queue holds 2" in error["message"]
        assert classify(base, ("a.jpg", JPEG), ("b.jpg", JPEG), field="files").status_code == 200


def test_a_missing_repository_stops_start_up_with_a_clear_message(tmp_path):
    env = {**os.environ, "VITSERVE_MODEL_REPOSITORY": str(tmp_path / "nowhere")}
    done = subprocess.run([sys.executable, "-m", "service", "--port", "0"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and f"error: no model repository at {tmp_path / 'nowhere'}" in done.stderr
