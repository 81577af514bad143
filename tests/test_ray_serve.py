"""Ray Serve: the service scaled out to two replicas behind Ray's HTTP proxy, on a local Ray instance."""
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from service_process import ROOT, direct_probabilities, free_port, metric, photo_bytes

JPEG = photo_bytes("chelsea", "JPEG")


def wait_for_line(log: Path, text: str, proc: subprocess.Popen, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in log.read_text().splitlines() if text in line]
        if found:
            return found[0]
        if proc.poll() is not None:
            raise RuntimeError(f"python -m service.ray_serve exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.5)
    raise TimeoutError(f"no {text!r} within {timeout}s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def ray_service(tmp_path_factory):
    port, log = free_port(), tmp_path_factory.mktemp("ray") / "serve.log"
    env = {**os.environ, "VITSERVE_WARMUP_RUNS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "service.ray_serve", "--replicas", "2", "--port", str(port)],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", wait_for_line(log, "replicas running", proc)
    finally:
        proc.terminate()  # the service deletes its application and stops the Ray instance it started
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_two_replicas_start_warm_and_answer_like_the_exported_model(ray_service):
    url, started = ray_service
    assert "2 replicas running" in started
    assert httpx.get(f"{url}/health/ready").status_code == 200  # Ray routes to a replica once its models are warm
    r = httpx.post(f"{url}/classify", files={"file": ("chelsea.jpg", JPEG)},
                   params={"model": "shapes-swin", "top_k": 6}, timeout=60)
    assert r.status_code == 200
    got = {p["index"]: p["score"] for p in r.json()["results"][0]["predictions"]}
    np.testing.assert_allclose([got[i] for i in range(6)], direct_probabilities(ROOT / "model_repository" / "shapes-swin", JPEG),
                               atol=1e-5)
    bad = httpx.post(f"{url}/classify", files={"file": ("x.jpg", b"not an image")})
    assert bad.status_code == 415 and bad.json()["error"]["code"] == "unsupported_media_type"


def test_requests_are_spread_over_both_replicas(ray_service):
    url, _ = ray_service
    for _ in range(21):
        assert httpx.post(f"{url}/classify", files={"file": ("chelsea.jpg", JPEG)},
                          params={"model": "shapes-vit"}, timeout=60).status_code == 200
    # each replica has its own metrics: an odd count split over two replicas shows two different totals
    seen = {metric(httpx.get(f"{url}/metrics").text, "vitserve_images_total", model="shapes-vit") for _ in range(30)}
    assert len(seen) == 2 and sum(seen) == 21
