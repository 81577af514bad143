"""Faults against a real server: a graph that does not match its manifest's sha256 and a graph that ONNX Runtime
cannot load are reported in /models with the reason, and the other models serve."""
import json
import shutil

import httpx
import pytest
from service_process import ROOT, direct_probabilities, photo_bytes, running_service

from repository import sha256

JPEG = photo_bytes("chelsea", "JPEG")


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
    with running_service(model_repository=repo, warmup_runs=0) as base:
        yield base


def test_failed_models_are_listed_with_why_and_the_others_serve(url):
    listed = httpx.get(f"{url}/models", timeout=10).json()
    assert "does not match the sha256" in listed["not_served"]["shapes-deit"]
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
