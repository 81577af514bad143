"""Models (re)loaded and unloaded while serving, through the Open Inference Protocol's repository extension and by
polling the repository: no request lost under load, a broken upload leaving the old graph serving, on both
backends, and Triton's client as is.

"Version 2" of shapes-vit is the int8 graph of the same model (its own answers, the same record layout), written
into shapes-vit's folder (or its version folder shapes-vit/2/) with a manifest that names it shapes-vit.
"""
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton
from service_process import (ROOT, direct_probabilities, free_port, metric, model_pixels, photo_bytes, role_pids,
                             running_service, service_and_process, write_model)
from tritonclient.utils import InferenceServerException

from repository import find_entries, scan, sha256

REPO = ROOT / "model_repository"
JPEG = photo_bytes("chelsea", "JPEG")
V1 = direct_probabilities(REPO / "shapes-vit", JPEG)
V2 = direct_probabilities(REPO / "shapes-vit-int8", JPEG)


@pytest.fixture
def repository(tmp_path) -> Path:
    shutil.copytree(REPO / "shapes-vit", tmp_path / "shapes-vit")
    (tmp_path / "shapes-deit").symlink_to(REPO / "shapes-deit")
    return tmp_path


def garbled(folder: Path) -> dict:
    """The folder's manifest with model.onnx's sha256 and size made those of whatever the file now holds."""
    manifest = json.loads((folder / "manifest.json").read_text())
    graph = folder / "model.onnx"
    manifest["files"]["model"].update(sha256=sha256(graph), bytes=graph.stat().st_size)
    return manifest


def probabilities(response: httpx.Response) -> np.ndarray:
    scores = {p["index"]: p["score"] for p in response.json()["results"][0]["predictions"]}
    return np.array([scores[i] for i in range(len(V1))])


def classify(client: httpx.Client, url: str, model: str = "shapes-vit") -> httpx.Response:
    return client.post(f"{url}/classify", params={"model": model, "top_k": len(V1)},
                       files={"file": ("cat.jpg", JPEG)})


def which(answer: np.ndarray) -> int:
    """1 or 2: the version whose direct session gave this answer (0: neither)."""
    return 1 if np.allclose(answer, V1, atol=1e-5) else 2 if np.allclose(answer, V2, atol=1e-5) else 0


def index(url: str) -> dict[str, dict]:
    return {row["name"]: row for row in httpx.post(f"{url}/v2/repository/index", timeout=30).json()}


@contextmanager
def hammering(url: str, clients: int) -> Iterator[tuple[list, list]]:
    """`clients` threads classifying with shapes-vit until the block ends: (answers as (sent at, status, version
    or error text), transport failures: resets and refusals, requests lost)."""
    answers, failures, stop = [], [], threading.Event()

    def client() -> None:
        with httpx.Client(timeout=60) as session:
            while not stop.is_set():
                sent = time.monotonic()
                try:
                    r = classify(session, url)
                    answers.append((sent, r.status_code, which(probabilities(r)) if r.status_code == 200 else r.text))
                except httpx.TransportError as e:
                    failures.append(repr(e))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    try:
        yield answers, failures
    finally:
        stop.set()
        for thread in threads:
            thread.join()


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_version_2_replaces_version_1_under_32_clients_with_no_request_lost_and_a_broken_3_leaves_2_serving(
        tmp_path, backend):
    write_model(tmp_path / "shapes-vit" / "1", REPO / "shapes-vit", "shapes-vit", version=1)
    with running_service(model_repository=tmp_path, model_control="explicit", backend=backend,
                         **({"workers": 2} if backend == "process" else {})) as url:
        assert httpx.get(f"{url}/v2/models/shapes-vit/versions/1/ready").status_code == 200
        with hammering(url, 32) as (answers, failures):
            time.sleep(1.5)
            write_model(tmp_path / "shapes-vit" / "2", REPO / "shapes-vit-int8", "shapes-vit", version=2)
            loaded = httpx.post(f"{url}/v2/repository/models/shapes-vit/load", timeout=120)
            switched = time.monotonic()
            time.sleep(1.5)
        assert loaded.status_code == 200, loaded.text
        assert not failures and answers and {status for _, status, _ in answers} == {200}
        assert {version for _, _, version in answers} == {1, 2}  # every answer is one graph's or the other's
        assert {version for sent, _, version in answers if sent > switched} == {2}
        assert index(url)["shapes-vit"] == {"name": "shapes-vit", "version": "2", "state": "READY", "reason": ""}
        assert httpx.get(f"{url}/v2/models/shapes-vit/versions/2/ready").status_code == 200
        assert httpx.get(f"{url}/v2/models/shapes-vit/versions/1/ready").status_code == 404
        assert httpx.get(f"{url}/v2/models/shapes-vit").json()["versions"] == ["2"]
        assert {m["name"]: m["version"] for m in httpx.get(f"{url}/models").json()["models"]}["shapes-vit"] == 2
        if backend == "thread":  # (the inference process's own metrics are not the workers')
            text = httpx.get(f"{url}/metrics").text
            assert metric(text, "vitserve_model_loads_total", model="shapes-vit", outcome="ok") == 2
            assert metric(text, "vitserve_model_load_seconds_count", model="shapes-vit") == 2
            info = [line for line in text.splitlines() if line.startswith("vitserve_model_info{")
                    and 'model="shapes-vit"' in line]
            assert len(info) == 1 and 'version="2"' in info[0]  # one series: what serves it now

        # a corrupt upload: refused with its reason, the version before it still serving
        write_model(tmp_path / "shapes-vit" / "3", REPO / "shapes-vit-int8", "shapes-vit", version=3)
        (tmp_path / "shapes-vit" / "3" / "model.onnx").write_bytes(b"not a graph")
        broken = httpx.post(f"{url}/v2/repository/models/shapes-vit/load", timeout=120)
        assert broken.status_code == 400
        assert "shapes-vit/3: model.onnx does not match the sha256" in broken.json()["error"]
        with httpx.Client(timeout=60) as session:
            assert which(probabilities(classify(session, url))) == 2
        row = index(url)["shapes-vit"]
        assert row["state"] == "READY" and row["version"] == "2" and "does not match the sha256" in row["reason"]
        # a graph ONNX Runtime cannot open, its sha256 right: refused with ONNX Runtime's reason
        (tmp_path / "shapes-vit" / "3" / "manifest.json").write_text(json.dumps(garbled(tmp_path / "shapes-vit" / "3")))
        unreadable = httpx.post(f"{url}/v2/repository/models/shapes-vit/load", timeout=120)
        assert unreadable.status_code == 400 and "protobuf" in unreadable.json()["error"].lower()
        with httpx.Client(timeout=60) as session:
            assert which(probabilities(classify(session, url))) == 2
        if backend == "thread":
            assert metric(httpx.get(f"{url}/metrics").text, "vitserve_model_loads_total", model="shapes-vit",
                          outcome="failed") == 2


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_unload_answers_what_it_accepted_then_404_and_a_load_brings_it_back(repository, backend):
    with running_service(model_repository=repository, model_control="explicit", backend=backend,
                         **({"workers": 2} if backend == "process" else {})) as url, httpx.Client(timeout=60) as c:
        client = triton.InferenceServerClient(url.removeprefix("http://"))
        assert {row["name"]: row["state"] for row in client.get_model_repository_index()} == {
            "shapes-deit": "READY", "shapes-vit": "READY"}
        kept = c.post(f"{url}/classify", params={"model": "shapes-vit", "attention": "true"},
                      files={"file": ("cat.jpg", JPEG)}).json()["results"][0]["attention_map_url"]
        with hammering(url, 16) as (answers, failures):
            time.sleep(1.0)
            client.unload_model("shapes-vit")
            unloaded = time.monotonic()
            time.sleep(0.5)
        # what was accepted is answered; after the unload, a clear 404
        assert not failures and {status for _, status, _ in answers} == {200, 404}
        assert {version for _, status, version in answers if status == 200} == {1}
        assert all(status == 404 for sent, status, _ in answers if sent > unloaded)
        gone = classify(c, url)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert c.post(f"{url}/v2/models/shapes-vit/infer", json={"inputs": []}).status_code == 404
        assert classify(c, url, "shapes-deit").status_code == 200  # the others serve on
        assert index(url)["shapes-vit"]["state"] == "UNAVAILABLE" and index(url)["shapes-vit"]["reason"] == "unloaded"
        assert "shapes-vit" not in {m["name"] for m in c.get(f"{url}/models").json()["models"]}
        assert c.get(f"{url}/health/ready").status_code == 200
        expired = c.get(f"{url}{kept}")
        assert expired.status_code == 404 and "expired with its model" in expired.json()["error"]["message"]
        client.load_model("shapes-vit")
        assert which(probabilities(classify(c, url))) == 1
        assert c.get(f"{url}{kept}").status_code == 200  # its model is back: the kept result draws again
        with pytest.raises(InferenceServerException, match="no folder"):
            client.load_model("no-such-model")
        # a new graph whose outputs differ cannot take over the records of requests under way
        write_model(repository / "shapes-vit", REPO / "shapes-deit", "shapes-vit")
        changed = c.post(f"{url}/v2/repository/models/shapes-vit/load")
        assert changed.status_code == 400 and "export it as a new version" in changed.json()["error"]
        assert which(probabilities(classify(c, url))) == 1


def test_without_explicit_model_control_load_and_unload_are_refused_and_the_index_answers(repository):
    port = free_port()
    with running_service(model_repository=repository, grpc_port=port) as url:
        for action in ("load", "unload"):
            r = httpx.post(f"{url}/v2/repository/models/shapes-vit/{action}")
            assert r.status_code == 403 and "VITSERVE_MODEL_CONTROL=explicit" in r.json()["error"]
        assert index(url)["shapes-vit"]["state"] == "READY"
        assert "model_repository" in httpx.get(f"{url}/v2").json()["extensions"]
        client = triton_grpc.InferenceServerClient(f"127.0.0.1:{port}")
        with pytest.raises(InferenceServerException, match="VITSERVE_MODEL_CONTROL=explicit") as refused:
            client.unload_model("shapes-vit")
        assert refused.value.status() == "StatusCode.PERMISSION_DENIED"


def test_the_repository_extension_over_grpc_as_tritonclient_speaks_it(repository):
    port = free_port()
    with running_service(model_repository=repository, model_control="explicit", grpc_port=port) as url, \
            httpx.Client(timeout=60) as c:
        client = triton_grpc.InferenceServerClient(f"127.0.0.1:{port}")
        rows = client.get_model_repository_index(as_json=True)["models"]
        assert {(row["name"], row["version"], row["state"]) for row in rows} == {
            ("shapes-deit", "1", "READY"), ("shapes-vit", "1", "READY")}
        client.unload_model("shapes-vit")
        assert classify(c, url).status_code == 404
        with pytest.raises(InferenceServerException, match="no model 'shapes-vit'"):
            client.is_model_ready("shapes-vit")
        rows = {row["name"]: row for row in client.get_model_repository_index(as_json=True)["models"]}
        assert rows["shapes-vit"]["state"] == "UNAVAILABLE" and rows["shapes-vit"]["reason"] == "unloaded"
        ready = httpx.post(f"{url}/v2/repository/index", json={"ready": True}).json()
        assert [(row["name"], row["state"]) for row in ready] == [("shapes-deit", "READY")]
        client.load_model("shapes-vit")
        assert which(probabilities(classify(c, url))) == 1


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_polling_applies_a_new_export_a_new_model_and_a_removed_one(repository, backend):
    with running_service(model_repository=repository, model_control="poll", poll_s=0.3, backend=backend,
                         **({"workers": 2} if backend == "process" else {})) as url, httpx.Client(timeout=60) as c:
        write_model(repository / "shapes-vit", REPO / "shapes-vit-int8", "shapes-vit")
        write_model(repository / "shapes-deit-copy", REPO / "shapes-deit", "shapes-deit-copy")
        (repository / "shapes-deit").unlink()
        deadline = time.monotonic() + 60
        while which(probabilities(classify(c, url))) != 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        while classify(c, url, "shapes-deit").status_code != 404 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert which(probabilities(classify(c, url))) == 2
        assert classify(c, url, "shapes-deit").status_code == 404
        while classify(c, url, "shapes-deit-copy").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert classify(c, url, "shapes-deit-copy").status_code == 200  # a new model: the workers learn of it too
        assert index(url)["shapes-deit-copy"]["state"] == "READY"
        assert "shapes-deit-copy" in {m["name"] for m in c.get(f"{url}/models").json()["models"]}


def test_a_model_folder_serves_its_latest_version_and_a_broken_one_is_named(tmp_path):
    write_model(tmp_path / "shapes-vit" / "1", REPO / "shapes-vit", "shapes-vit", version=1)
    write_model(tmp_path / "shapes-vit" / "2", REPO / "shapes-vit-int8", "shapes-vit", version=2)
    (entry,), problems = scan(tmp_path)  # no policy.json: the latest
    assert (entry.version, entry.key, entry.folder) == (2, "shapes-vit@2", tmp_path / "shapes-vit" / "2")
    assert problems == {} and [e.version for e in find_entries(tmp_path, "shapes-vit")] == [2]
    for policy, served in (({"all": True}, [1, 2]), ({"latest": 5}, [1, 2]), ({"specific": [1, 7]}, [1])):
        (tmp_path / "shapes-vit" / "policy.json").write_text(json.dumps(policy))
        assert [e.version for e in scan(tmp_path)[0]] == served
    (tmp_path / "shapes-vit" / "policy.json").write_text('{"newest": 1}')
    assert "policy.json must be" in scan(tmp_path)[1]["shapes-vit"]
    (tmp_path / "shapes-vit" / "policy.json").unlink()
    write_model(tmp_path / "shapes-vit" / "10", REPO / "shapes-vit-int8", "shapes-vit", version=9)
    assert scan(tmp_path) == ([], {"shapes-vit/10": "shapes-vit/10: its manifest says version 9"})


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_versions_serve_side_by_side_by_policy_and_a_new_version_may_change_the_layout(tmp_path, backend):
    """policy {"all": true}: versions 1 and 2 both answer, each on its own route, the name reaching the latest;
    then version 3, another architecture with other outputs, takes over the name under load, no request lost."""
    write_model(tmp_path / "shapes-vit" / "1", REPO / "shapes-vit", "shapes-vit", version=1)
    write_model(tmp_path / "shapes-vit" / "2", REPO / "shapes-vit-int8", "shapes-vit", version=2)
    (tmp_path / "shapes-vit" / "policy.json").write_text('{"all": true}')
    with running_service(model_repository=tmp_path, model_control="explicit", backend=backend,
                         **({"workers": 2} if backend == "process" else {})) as url, httpx.Client(timeout=60) as c:
        pixels = model_pixels(REPO / "shapes-vit", JPEG)[None]
        for version, want in (("1", V1), ("2", V2)):
            body = {"inputs": [{"name": "images", "shape": list(pixels.shape), "datatype": "UINT8",
                                "data": pixels.ravel().tolist()}]}
            r = c.post(f"{url}/v2/models/shapes-vit/versions/{version}/infer", json=body)
            logits = np.array(r.json()["outputs"][0]["data"], np.float64)
            assert r.json()["model_version"] == version
            np.testing.assert_allclose(np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum(), want,
                                       atol=1e-5)
        assert which(probabilities(classify(c, url))) == 2  # the name reaches the latest
        assert c.get(f"{url}/v2/models/shapes-vit").json()["versions"] == ["1", "2"]
        assert sorted((m["name"], m["version"]) for m in c.get(f"{url}/models").json()["models"]
                      if m["name"] == "shapes-vit") == [("shapes-vit", 1), ("shapes-vit", 2)]
        with hammering(url, 16) as (answers, failures):
            time.sleep(1.0)
            write_model(tmp_path / "shapes-vit" / "3", REPO / "shapes-deit", "shapes-vit", version=3)
            (tmp_path / "shapes-vit" / "policy.json").write_text('{"latest": 1}')
            loaded = c.post(f"{url}/v2/repository/models/shapes-vit/load", timeout=120)
            switched = time.monotonic()
            time.sleep(1.0)
        assert loaded.status_code == 200, loaded.text
        assert not failures and {status for _, status, _ in answers} == {200}
        # DeiT's answers are neither version's: after the switch, every answer is version 3's
        assert all(version == 0 for sent, _, version in answers if sent > switched)
        deit = direct_probabilities(REPO / "shapes-deit", JPEG)
        np.testing.assert_allclose(probabilities(classify(c, url)), deit, atol=1e-5)
        assert {(row["name"], row["version"]): row["state"] for row in httpx.post(
            f"{url}/v2/repository/index").json() if row["name"] == "shapes-vit"} == {
            ("shapes-vit", "1"): "UNAVAILABLE", ("shapes-vit", "2"): "UNAVAILABLE", ("shapes-vit", "3"): "READY"}
        assert c.get(f"{url}/v2/models/shapes-vit/versions/2/ready").status_code == 404


def test_a_new_inference_process_serves_the_folder_as_it_is_now_and_the_workers_follow_it(tmp_path):
    """Under the process backend, with nothing reloading models: the folder re-exported with other labels while
    serving, then the inference process killed; the one that replaces it reads the folder anew, and the workers'
    answers follow its manifest (they kept their pipeline of the old one, as a restart counts loads from 1 again)."""
    write_model(tmp_path / "shapes-vit", REPO / "shapes-vit", "shapes-vit")
    labels = json.loads((REPO / "shapes-vit" / "manifest.json").read_text())["labels"]
    renamed = [f"{label}-2" for label in labels]

    def top_label(url: str) -> str | None:
        r = httpx.post(f"{url}/classify", files={"file": ("a.jpg", JPEG)}, timeout=30)
        return r.json()["results"][0]["predictions"][0]["label"] if r.status_code == 200 else None

    with service_and_process(model_repository=tmp_path, backend="process", workers=1) as (url, process):
        before = top_label(url)
        write_model(tmp_path / "shapes-vit", REPO / "shapes-vit", "shapes-vit", labels=renamed)
        (inference,) = role_pids(process.pid, "vitserve-infer")
        os.kill(inference, signal.SIGKILL)
        deadline = time.monotonic() + 120  # a liveness bound, not a measurement
        while (after := top_label(url)) != f"{before}-2":
            assert time.monotonic() < deadline, f"the workers still answer {after!r}, not {before}-2"
            time.sleep(0.1)
    assert before in labels
