"""Faults against a real server: a graph that does not match its manifest's sha256 and a graph that ONNX Runtime
cannot load are reported in /models with the reason, and the other models serve; a batch that ONNX Runtime fails
on fails only its own requests; clients that go away mid-upload or mid-queue leave nothing behind."""
import json
import shutil
import time
from pathlib import Path

import httpx
import onnx
import pytest
from onnx import TensorProto, helper
from prometheus_client.parser import text_string_to_metric_families
from service_process import (ROOT, direct_probabilities, leave_mid_request, photo_bytes, process_metrics,
                             running_service)

from repository import sha256

JPEG = photo_bytes("chelsea", "JPEG")
DARK, BRIGHT = photo_bytes("coffee", "JPEG"), photo_bytes("astronaut", "JPEG")  # top-left pixel 40 / 177 as input


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    repo = tmp_path_factory.mktemp("faulty-repository")
    for name in ("shapes-vit", "shapes-deit", "shapes-swin"):
        shutil.copytree(ROOT / "model_repository" / name, repo / name)
    tampered = repo / "shapes-deit" / "model.onnx"  # one byte changed after export
    data = bytearray(tampered.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tampered.write_bytes(bytes(data))
    broken = repo / "shapes-swin"  # not ONNX at all, though its manifest vouches for it
    (broken / "model.onnx").write_bytes(b"this is not an ONNX graph")
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["files"]["model"].update(sha256=sha256(broken / "model.onnx"), bytes=25)
    (broken / "manifest.json").write_text(json.dumps(manifest))
    fragile(ROOT / "model_repository" / "shapes-vit", repo / "shapes-vit-fragile")
    (repo / "notes").mkdir()  # a stray folder: listed with why
    (repo / ".cache").mkdir()  # a hidden one: not a candidate
    with running_service(model_repository=repo, warmup_runs=0, max_queue_delay_ms=200) as base:
        yield base


def fragile(source: Path, target: Path) -> None:
    """A copy of a model whose graph fails at run time on a batch holding an image whose top-left input pixel is
    128 or brighter: that pixel indexes a 128-entry table (Gather out of bounds), and adds 0 to the logits."""
    shutil.copytree(source, target)
    graph = onnx.load(target / "model.onnx")
    for node in graph.graph.node:
        node.output[:] = ["logits_before" if o == "logits" else o for o in node.output]
    graph.graph.initializer.extend([
        helper.make_tensor("table", TensorProto.FLOAT, [128], [0.0] * 128),
        helper.make_tensor("zeros4", TensorProto.INT64, [4], [0, 0, 0, 0]),
        helper.make_tensor("ones3", TensorProto.INT64, [4], [2**62, 1, 1, 1]),
        helper.make_tensor("column", TensorProto.INT64, [2], [-1, 1])])
    graph.graph.node.extend([
        helper.make_node("Slice", ["images", "zeros4", "ones3"], ["corner"]),
        helper.make_node("Cast", ["corner"], ["index"], to=TensorProto.INT64),
        helper.make_node("Reshape", ["index", "column"], ["indices"]),
        helper.make_node("Gather", ["table", "indices"], ["nothing"]),
        helper.make_node("Add", ["logits_before", "nothing"], ["logits"])])
    onnx.save(graph, target / "model.onnx")
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["name"] = target.name
    graph_file = target / "model.onnx"
    manifest["files"]["model"].update(sha256=sha256(graph_file), bytes=graph_file.stat().st_size)
    (target / "manifest.json").write_text(json.dumps(manifest))


def test_failed_models_are_listed_with_why_and_the_others_serve(url):
    listed = httpx.get(f"{url}/models", timeout=10).json()
    assert "does not match the sha256" in listed["not_served"]["shapes-deit"]
    assert "no manifest.json" in listed["not_served"]["notes"] and ".cache" not in listed["not_served"]
    models = {m["name"]: m for m in listed["models"]}
    assert models["shapes-vit"]["ready"] and models["shapes-vit"]["error"] is None
    assert not models["shapes-swin"]["ready"] and models["shapes-swin"]["error"]
    r = httpx.post(f"{url}/classify", files={"file": ("a.jpg", JPEG)}, params={"model": "shapes-vit", "top_k": 6},
                   timeout=30)
    assert r.status_code == 200, r.text
    got = {p["index"]: p["score"] for p in r.json()["results"][0]["predictions"]}
    want = direct_probabilities(ROOT / "model_repository" / "shapes-vit", JPEG)
    assert max(abs(got[i] - want[i]) for i in range(6)) < 1e-5


def test_requests_for_a_failed_model_get_a_clear_error_not_a_crash(url):
    for name, status in (("shapes-swin", 503), ("shapes-deit", 404)):
        r = httpx.post(f"{url}/classify", files={"file": ("a.jpg", JPEG)}, params={"model": name}, timeout=30)
        assert r.status_code == status and r.json()["error"]["message"], r.text
    assert httpx.get(f"{url}/health/live", timeout=10).status_code == 200
    # readiness: every model loaded or failed, and at least one serving
    assert httpx.get(f"{url}/health/ready", timeout=10).status_code == 200


def test_a_batch_onnx_runtime_fails_on_fails_only_its_own_requests(url):
    def classify(*images: bytes) -> httpx.Response:
        return httpx.post(f"{url}/classify", files=[("files", (f"{i}.jpg", image)) for i, image in enumerate(images)],
                          params={"model": "shapes-vit-fragile"}, timeout=30)

    # the dark image in the batch of a bright one (one request's images are one batch, whatever the timing)
    together = classify(DARK, BRIGHT)
    assert together.status_code == 500 and together.json()["error"]["code"] == "inference_failed", together.text
    assert "Gather" in together.json()["error"]["message"]  # ONNX Runtime's own words
    after = classify(DARK)
    assert after.status_code == 200, after.text
    want = direct_probabilities(ROOT / "model_repository" / "shapes-vit", DARK)
    assert max(p["score"] for p in after.json()["results"][0]["predictions"]) == pytest.approx(want.max(), abs=1e-5)


def test_clients_that_leave_mid_upload_or_mid_queue_leave_nothing_behind(url):
    def figures() -> tuple[float, float, float]:
        """/classify requests finished (any status), images computed and images queued, for shapes-vit."""
        families = {f.name: f.samples for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}
        finished = sum(s.value for s in families["vitserve_requests"]
                       if s.name == "vitserve_requests_total" and s.labels["route"] == "/classify")
        images, queued = (next((s.value for s in families[name] if s.labels.get("model") == "shapes-vit"), 0.0)
                          for name in ("vitserve_images", "vitserve_queue_depth"))  # 0 until shapes-vit has run
        return finished, images, queued

    before = process_metrics(httpx.get(f"{url}/metrics").text)["process_open_fds"]
    finished, computed, _ = figures()
    leave_mid_request(url, "shapes-vit", JPEG, images=32, clients=10)
    deadline = time.monotonic() + 60
    while (now := figures())[0] < finished + 20 or now[2] > 0:  # every one of the 20 requests over, none queued
        assert time.monotonic() < deadline, f"abandoned requests still in the service: {now}"
        time.sleep(0.2)
    assert now[1] - computed < 320 / 2  # most of the 320 images were dropped, not run for nobody
    ok = httpx.post(f"{url}/classify", files={"file": ("a.jpg", JPEG)}, params={"model": "shapes-vit"}, timeout=30)
    assert ok.status_code == 200, ok.text
    assert figures()[1] > now[1]  # the count that held the line is live (a batch may still have been running)
    assert process_metrics(httpx.get(f"{url}/metrics").text)["process_open_fds"] <= before + 2  # nothing left open
