"""Readiness as strict as Triton's, by default: /health/ready, /v2/health/ready and gRPC's ServerReady say ready only
when every model of the repository serves, on both backends; VITSERVE_STRICT_READINESS=false relaxes it to one.
And on a real server: a plan pinned for every model runs where its export verified it, the others take auto and
say so, and every answer (/classify, /embed, /expression, /v2 over REST and gRPC) names its plan; auto on every
embedded model, each of which answers a photo beside noise as it answers it alone."""
import time

import grpc
import httpx
import numpy as np
import pytest
from service_process import ROOT, free_port, model_pixels, photo_bytes, running_service, write_model

from repository import read_entry
from service.engine.cpu_plans import verified
from service.protocol import open_inference_pb2 as pb
from service.protocol.grpc_server import SERVICE

REPO = ROOT / "model_repository"
JPEG = photo_bytes("chelsea", "JPEG")


def settled(url: str) -> dict[str, dict]:
    """/models once no model is loading (a liveness bound, not a measurement)."""
    deadline = time.monotonic() + 120
    while True:
        models = {m["name"]: m for m in httpx.get(f"{url}/models", timeout=10).json()["models"]}
        if all(m["ready"] or m["error"] for m in models.values()):
            return models
        assert time.monotonic() < deadline, models
        time.sleep(0.1)


def server_ready(grpc_port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        call = channel.unary_unary(f"/{SERVICE}/ServerReady", pb.ServerReadyRequest.SerializeToString,
                                   pb.ServerReadyResponse.FromString)
        return call(pb.ServerReadyRequest(), timeout=10).ready


@pytest.fixture(scope="module")
def half_broken(tmp_path_factory):
    """shapes-vit as exported, and shapes-deit whose graph was cut short after its export (its sha256 fails)."""
    root = tmp_path_factory.mktemp("repository")
    write_model(root / "shapes-vit", REPO / "shapes-vit", "shapes-vit")
    write_model(root / "shapes-deit", REPO / "shapes-deit", "shapes-deit")
    graph = root / "shapes-deit" / "model.onnx"
    graph.write_bytes(graph.read_bytes()[: graph.stat().st_size // 2])
    return root


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_a_server_missing_a_model_is_not_ready_unless_asked_to_be_while_one_serves(half_broken, backend):
    for strict in (True, False):
        with running_service(wait_ready=False, backend=backend, workers=1, model_repository=half_broken,
                             strict_readiness=str(strict).lower(), grpc_port=(port := free_port())) as url:
            models = settled(url)
            ready, v2 = httpx.get(f"{url}/health/ready", timeout=10), httpx.get(f"{url}/v2/health/ready", timeout=10)
            served = httpx.post(f"{url}/classify", files={"file": ("a.jpg", JPEG)}, params={"model": "shapes-vit"},
                                timeout=30)
            grpc_ready = server_ready(port)
        assert models["shapes-vit"]["ready"] and served.status_code == 200, served.text  # what serves, serves
        if strict:
            assert ready.status_code == 503 and ready.json()["error"]["code"] == "models_not_serving", ready.text
            assert "shapes-deit" in ready.json()["error"]["message"] and "Retry-After" in ready.headers
            assert v2.status_code == 400 and "shapes-deit does not serve" in v2.json()["error"], v2.text
            assert grpc_ready is False
        else:
            assert (ready.status_code, v2.status_code, grpc_ready) == (200, 200, True), (ready.text, v2.text)


@pytest.fixture(scope="module")
def pinned_for_every_model():
    """The embedded repository with onnxruntime:fp32 pinned for every model: shapes-vit-int8's export verified
    int8 alone."""
    with running_service(cpu_plan="onnxruntime:fp32", grpc_port=(port := free_port())) as url:
        yield url, port


def test_a_plan_pinned_for_every_model_runs_where_its_export_verified_it_and_the_others_say_why(
        pinned_for_every_model):
    url, _ = pinned_for_every_model
    models = settled(url)
    assert httpx.get(f"{url}/health/ready", timeout=10).status_code == 200  # every model serves
    assert all(m["plan"] == "onnxruntime:fp32" for name, m in models.items() if name != "shapes-vit-int8"), models
    int8 = models["shapes-vit-int8"]
    assert int8["plan"] == "onnxruntime:int8" and "VITSERVE_CPU_PLAN=onnxruntime:fp32 is not for it" in int8[
        "plan_reason"] and "one at a time" in int8["plan_reason"]


def test_every_answer_names_the_plan_that_made_it(pinned_for_every_model):
    url, port = pinned_for_every_model
    upload = {"file": ("a.jpg", JPEG)}
    classified = httpx.post(f"{url}/classify", files=upload, params={"model": "shapes-vit-int8"}, timeout=30)
    embedded = httpx.post(f"{url}/embed", files=upload, params={"model": "shapes-swin"}, timeout=30)
    faces = httpx.post(f"{url}/expression", files={"file": ("a.jpg", photo_bytes("astronaut", "JPEG"))}, timeout=30)
    pixels = model_pixels(REPO / "shapes-deit", JPEG)[None]
    body = {"inputs": [{"name": "images", "shape": list(pixels.shape), "datatype": "UINT8",
                        "data": pixels.ravel().tolist()}]}
    v2 = httpx.post(f"{url}/v2/models/shapes-deit/infer", json=body, timeout=30)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        infer = channel.unary_unary(f"/{SERVICE}/ModelInfer", pb.ModelInferRequest.SerializeToString,
                                    pb.ModelInferResponse.FromString)
        request = pb.ModelInferRequest(model_name="shapes-deit", raw_input_contents=[pixels.tobytes()])
        request.inputs.add(name="images", datatype="UINT8", shape=pixels.shape)
        answered = infer(request, timeout=30)
    assert [r.json()["plan"] for r in (classified, embedded, faces)] == ["onnxruntime:int8", "onnxruntime:fp32",
                                                                        "onnxruntime:fp32"]
    assert v2.json()["parameters"] == {"plan": "onnxruntime:fp32"}
    assert answered.parameters["plan"].string_param == "onnxruntime:fp32"


def test_auto_chooses_for_every_embedded_model_and_each_answers_a_photo_beside_noise_as_alone(tmp_path):
    """One /v2 request of the photo, then one of the photo and 15 noise images (one batch): the photo's outputs
    agree within the plan's arithmetic, whichever plan auto chose (int8's images run one at a time)."""
    noise = np.random.default_rng(0).integers(0, 256, (15, 96, 96, 3), np.uint8)
    with running_service(cpu_plan="auto", cpu_plan_dir=tmp_path) as url:
        models = settled(url)
        answers = {}
        for name in ("shapes-vit", "shapes-deit", "shapes-swin", "shapes-vit-int8"):
            photo = model_pixels(REPO / name, JPEG)[None]
            answers[name] = [infer(url, name, x) for x in (photo, np.concatenate([photo, noise]))]
    for name, model in models.items():
        assert model["ready"] and model["plan"] in {p.name for p in verified(read_entry(REPO / name))}, (name, model)
    for name, (alone, beside) in answers.items():
        atol = {"fp32": 1e-5, "int8": 0.0}.get(models[name]["plan"].split(":")[1], 0.05)
        for output in ("logits", "embeddings"):
            np.testing.assert_allclose(beside[output][:1], alone[output], atol=atol, rtol=0,
                                       err_msg=f"{name} {output} on {models[name]['plan']}")


def infer(url: str, model: str, x: np.ndarray) -> dict[str, np.ndarray]:
    body = {"inputs": [{"name": "images", "shape": list(x.shape), "datatype": "UINT8", "data": x.ravel().tolist()}]}
    r = httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return {o["name"]: np.reshape(o["data"], o["shape"]) for o in r.json()["outputs"]}
