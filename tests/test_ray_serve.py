"""Ray Serve: the service scaled out to two replicas behind Ray's HTTP proxy, on a local Ray instance."""
import httpx
import numpy as np
import pytest
from service_process import ROOT, direct_probabilities, metric, photo_bytes, running_ray_service

JPEG = photo_bytes("chelsea", "JPEG")


@pytest.fixture(scope="module")
def ray_service(tmp_path_factory):
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    with running_ray_service(2, log, session_affinity=True, warmup_runs=1) as service:
        yield service


def test_two_replicas_start_warm_and_answer_like_the_exported_model(ray_service):
    url, started = ray_service
    assert "2 replicas running" in started
    assert httpx.get(f"{url}/health/ready").status_code == 200  # Ray routes to a replica once its models are warm
    r = httpx.post(f"{url}/classify", files={"file": ("chelsea.jpg", JPEG)},
                   params={"model": "shapes-swin", "top_k": 6}, timeout=60)
    assert r.status_code == 200
    got = {p["index"]: p["score"] for p in r.json()["results"][0]["predictions"]}
    want = direct_probabilities(ROOT / "model_repository" / "shapes-swin", JPEG)
    np.testing.assert_allclose([got[i] for i in range(6)], want, atol=1e-5)
    bad = httpx.post(f"{url}/classify", files={"file": ("x.jpg", b"not an image")})
    assert bad.status_code == 415 and bad.json()["error"]["code"] == "unsupported_media_type"


def test_requests_are_spread_over_both_replicas(ray_service):
    """Which replica serves a request is Ray's router's choice, so this sends until both have served some, and
    reads each replica's own count (shapes-deit's: no other test here runs it) from its /metrics, which Ray
    routes as it likes too. An odd number sent tells the two apart: their counts differ, and add up to it."""
    url, _ = ray_service
    sent = 0
    while True:
        for _ in range(21 if sent == 0 else 20):  # an odd number in all
            assert httpx.post(f"{url}/classify", files={"file": ("chelsea.jpg", JPEG)},
                              params={"model": "shapes-deit"}, timeout=60).status_code == 200
            sent += 1
        counts = set()
        for _ in range(100):  # until both replicas have answered
            counts.add(metric(httpx.get(f"{url}/metrics").text, "vitserve_images_total", model="shapes-deit"))
            if len(counts) == 2:
                break
        assert len(counts) == 2, f"100 GET /metrics all reached one replica, which counts {counts}"
        if 0 not in counts:  # each replica served some
            break
        assert sent < 200, f"all {sent} requests went to one replica"
    assert sum(counts) == sent, (counts, sent)


def test_a_session_header_brings_attention_maps_back_from_the_replica_that_made_them(ray_service):
    url, _ = ray_service
    for session in ("alice", "bob", "carol"):
        headers = {"x-session-id": session}
        r = httpx.post(f"{url}/classify", files={"file": ("chelsea.jpg", JPEG)}, headers=headers,
                       params={"model": "shapes-vit", "attention": "true"}, timeout=60)
        map_url = r.json()["results"][0]["attention_map_url"]
        # without the header about half of these would reach the other replica, which never saw the id
        assert all(httpx.get(f"{url}{map_url}", headers=headers, timeout=60).status_code == 200 for _ in range(8))
