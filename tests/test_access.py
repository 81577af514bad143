"""Access control against a real server: the optional API key, CORS, and request paths that cannot name a file
outside the model repository."""
import http.client
from urllib.parse import urlsplit

import httpx
import pytest
from service_process import photo_bytes, running_service

KEY = "vitserve-test-key-5b1f0c"
APP = "https://app.example"
JPEG = photo_bytes("chelsea", "JPEG")


@pytest.fixture(scope="module")
def url():
    with running_service(api_key=KEY, cors_origins=f'["{APP}"]') as base:
        yield base


def request(url: str, method: str, path: str, key: str | None = None, headers: dict | None = None,
            **kwargs) -> httpx.Response:
    headers = {**(headers or {}), **({"X-API-Key": key} if key is not None else {})}
    return httpx.request(method, f"{url}{path}", headers=headers, timeout=30, **kwargs)


CLOSED = [("POST", "/classify", {"files": {"file": ("a.jpg", JPEG)}}),
          ("POST", "/expression", {"files": {"file": ("a.jpg", JPEG)}}),
          ("POST", "/attention-map", {"files": {"file": ("a.jpg", JPEG)}}),
          ("GET", "/attention-map?id=0", {}), ("GET", "/models", {}), ("GET", "/v2/models/shapes-vit", {}),
          ("GET", "/v2/models/shapes-vit/ready", {}), ("POST", "/v2/models/shapes-vit/infer", {"json": {}}),
          ("POST", "/v1/embeddings", {"json": {"input": "a"}})]
OPEN = ["/health/live", "/health/ready", "/metrics", "/docs", "/openapi.json", "/v2", "/v2/", "/v2/health/ready", "/"]


@pytest.mark.parametrize("method, path, kwargs", CLOSED, ids=[f"{m} {p}" for m, p, _ in CLOSED])
def test_inference_and_model_routes_answer_401_without_the_right_key(url, method, path, kwargs):
    for key, words in ((None, "X-API-Key header"), ("wrong", "wrong API key"), (KEY[:-1], "wrong API key")):
        r = request(url, method, path, key, **kwargs)
        assert r.status_code == 401, r.text
        error = r.json()["error"]  # the Open Inference Protocol's errors are a bare message
        assert words in error if path.startswith("/v2/") else (error["code"] == "unauthorized" and words in
                                                               error["message"])
        assert r.headers["WWW-Authenticate"] == 'APIKey header="X-API-Key"'


def test_with_the_key_every_route_serves_and_health_metrics_and_docs_need_none(url):
    classified = request(url, "POST", "/classify", KEY, files={"file": ("a.jpg", JPEG)})
    assert classified.status_code == 200 and classified.json()["results"][0]["predictions"]
    assert request(url, "GET", "/models", KEY).status_code == 200
    assert request(url, "GET", "/v2/models/shapes-vit", KEY).json()["name"] == "shapes-vit"
    for path in OPEN:
        assert request(url, "GET", path).status_code == 200, path
    # /v2/ is /v2 itself, not a redirect to it, and open as it is
    assert request(url, "GET", "/v2/").json() == request(url, "GET", "/v2").json()
    assert request(url, "HEAD", "/v2/").status_code == request(url, "HEAD", "/v2").status_code


def test_a_bearer_token_is_the_key_as_openais_clients_send_it(url):
    """Authorization: Bearer KEY passes where X-API-Key: KEY does; a wrong, cut or empty token, another scheme, or
    a right token beside a wrong X-API-Key (the header named first wins) does not."""
    def bearer(value: str, **extra) -> httpx.Response:
        return request(url, "POST", "/classify", headers={"Authorization": value, **extra},
                       files={"file": ("a.jpg", JPEG)})
    assert bearer(f"Bearer {KEY}").status_code == 200
    assert bearer(f"bearer  {KEY}").status_code == 200  # the scheme's case and spaces, as RFC 9110 allows
    for value in (f"Bearer {KEY[:-1]}", "Bearer", f"Basic {KEY}", KEY, f"Bearer {KEY}x", f"Token {KEY}"):
        r = bearer(value)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized", (value, r.text)
    assert bearer(f"Bearer {KEY}", **{"X-API-Key": "wrong"}).status_code == 401


def test_cors_lets_the_configured_origin_call_with_the_key_and_no_other(url):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "x-api-key"}
    allowed = request(url, "OPTIONS", "/classify", headers={"Origin": APP, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == APP
    assert "x-api-key" in allowed.headers["access-control-allow-headers"].lower()
    other = request(url, "OPTIONS", "/classify", headers={"Origin": "https://elsewhere.example", **preflight})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    answered = request(url, "GET", "/models", KEY, headers={"Origin": APP})
    assert answered.headers["access-control-allow-origin"] == APP


def raw_get(url: str, target: str) -> int:
    """The status of a GET for `target` exactly as written: no client normalises its dots away."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("GET", target, headers={"X-API-Key": KEY})
        return connection.getresponse().status
    finally:
        connection.close()


@pytest.mark.parametrize("target", [
    "/v2/models/../../../etc/passwd", "/v2/models/..%2F..%2F..%2Fetc%2Fpasswd", "/v2/models/%2Fetc%2Fpasswd",
    "/v2/models/shapes-vit%2F..%2F..%2Fservice%2Fapp.py", "/attention-map?id=..%2F..%2Fetc%2Fpasswd",
    "/models/../model_repository/shapes-vit/model.onnx", "/model_repository/shapes-vit/manifest.json",
    "/classify/../../model_repository/shapes-vit/model.onnx", "/%2e%2e/%2e%2e/etc/passwd",
    # the one route that serves files from disk: the API docs' scripts
    "/docs/static/../../../pyproject.toml", "/docs/static/..%2F..%2F..%2Fpyproject.toml",
    "/docs/static/%2e%2e/%2e%2e/%2e%2e/etc/passwd"])
def test_no_request_path_reaches_a_file(url, target):
    assert raw_get(url, target) in (400, 404, 405)


def test_a_model_name_is_a_name_not_a_path(url):
    for name in ("../../etc/passwd", "/etc/passwd", "shapes-vit/../shapes-deit", "model_repository/shapes-vit"):
        r = request(url, "POST", "/classify", KEY, params={"model": name}, files={"file": ("a.jpg", JPEG)})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
