"""The HTTP layer in this process: create_app takes a backend, so routes, errors and limits are tested without a
server process, over the real LocalBackend or over a backend that misbehaves on purpose."""
import asyncio
import dataclasses
import json
import shutil
import threading
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
from fastapi import APIRouter, Request
from fastapi.routing import iter_route_contexts
from pydantic import BaseModel
from service_process import ROOT, direct_probabilities, metric, photo_bytes, write_model

from repository import ModelEntry, RepositoryError, servable
from service.http.app import create_app
from service.engine.backends import Lease, ModelStatus
from service.engine.backends.local import LocalBackend
from service.core.errors import overloaded
from service.core.metrics import Metrics
from service.engine.heads import HEADS, OUTPUTS_ONLY
from service.engine.records import record_dtype
from service.http.routes.uploads import read_images
from service.pipeline.pipeline import Pipeline
from service.core.settings import Settings

REPO = ROOT / "model_repository"
JPEG = photo_bytes("chelsea", "JPEG")


async def call(app, requests, raise_app_exceptions: bool = True):
    """Each (method, path, kwargs) through the app in this process, start-up and shut-down included (an exception
    the app raises after its answer, as uvicorn would log it, raised here too unless told not to)."""
    async with app.router.lifespan_context(app):
        await app.state.pipelines.backend.loaded()
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
        async with httpx.AsyncClient(transport=transport, base_url="http://vitserve") as client:
            return await asyncio.gather(*(client.request(method, path, **kw) for method, path, kw in requests))


def test_the_app_over_a_local_backend_in_this_process():
    settings = Settings(model_repository=REPO, warmup_runs=0)
    backend = LocalBackend(settings, Metrics())
    app = create_app(settings, backend, metrics=Metrics())
    three = [("files", (f"{i}.jpg", JPEG)) for i in range(3)]
    classified, models, kept = asyncio.run(call(app, [
        ("POST", "/classify", {"files": {"file": ("a.jpg", JPEG)}, "params": {"model": "shapes-vit", "top_k": 6}}),
        ("GET", "/models", {}),
        ("POST", "/classify", {"files": three, "params": {"model": "shapes-deit", "attention": "true"}})]))
    got = {p["index"]: p["score"] for p in classified.json()["results"][0]["predictions"]}
    np.testing.assert_allclose([got[i] for i in range(6)], direct_probabilities(REPO / "shapes-vit", JPEG), atol=1e-5)
    assert {m["name"]: m["decode"] for m in models.json()["models"]}["shapes-vit"] == "cpu"
    assert all(m["decode_reason"] is None for m in models.json()["models"])  # on the CPU no GPU decoding was asked
    assert models.json()["face_detector"] == {"name": "mtcnn", "provider": "CPUExecutionProvider", "error": None,
                                              "landmarks": ["left_eye", "right_eye", "nose", "mouth_left",
                                                            "mouth_right"]}
    # each kept result owns its arrays (no views of the request's or the batch's rows): the cache's byte count
    # is what it holds
    records = [backend.cache.get(result["id"]) for result in kept.json()["results"]]
    arrays = [a for r in records for a in (r.image, r.photo, *r.attention.values())]
    assert len(records) == 3 and not any(isinstance(a.base, np.ndarray) for a in arrays)
    assert backend.cache.nbytes == sum(a.nbytes for a in arrays)


@dataclasses.dataclass(frozen=True)
class Argmax:
    """A task's head of the test's own: each image's best label, and nothing else."""

    @classmethod
    def of(cls, entry: ModelEntry) -> "Argmax":
        return cls()

    def fields(self) -> list[tuple]:
        return [("best", np.int32)]

    def finish(self, outputs: dict[str, np.ndarray], k: int) -> dict[str, np.ndarray]:
        return {} if k == OUTPUTS_ONLY else {"best": outputs["logits"].argmax(axis=1).astype(np.int32)}


argmax_route = APIRouter()


class Best(BaseModel):
    label: str


@argmax_route.post("/argmax", response_model=Best)
async def argmax(request: Request, model: str) -> dict:
    async def read(chosen: Pipeline) -> list[tuple[str | None, bytes]]:
        return await read_images(request, ("file",), 1)

    pipeline, ((_, data),) = await request.app.state.pipelines.routed(read, model, task="argmax")
    out = await pipeline.images([data])
    return {"label": pipeline.entry.labels[int(out.fields["best"][0])]}


def test_a_new_task_is_a_head_and_a_route_and_nothing_else(tmp_path, monkeypatch):
    """A model exported with a task of its own ("argmax"): its head registered and its route added, nothing else
    of the service changed, and it serves; /classify and /expression take it for what it is (a 400 naming its
    task), and /attention-map draws its map without a prediction."""
    write_model(tmp_path / "shapes-argmax", REPO / "shapes-vit", "shapes-argmax", task="argmax")
    write_model(tmp_path / "shapes-vit", REPO / "shapes-vit", "shapes-vit")
    monkeypatch.setitem(HEADS, "argmax", Argmax.of)
    settings = Settings(model_repository=tmp_path, warmup_runs=0)
    app = create_app(settings, LocalBackend(settings, Metrics()), metrics=Metrics())
    app.include_router(argmax_route)
    upload = {"files": {"file": ("a.jpg", JPEG)}, "params": {"model": "shapes-argmax"}}
    best, classified, faces, drawn = asyncio.run(call(app, [
        ("POST", path, upload) for path in ("/argmax", "/classify", "/expression", "/attention-map")]))
    labels = json.loads((REPO / "shapes-vit" / "manifest.json").read_text())["labels"]
    assert best.status_code == 200, best.text
    assert best.json() == {"label": labels[int(np.argmax(direct_probabilities(REPO / "shapes-vit", JPEG)))]}
    assert classified.status_code == 400 and classified.json()["error"]["code"] == "no_classifier", classified.text
    assert faces.status_code == 400 and "of task argmax" in faces.json()["error"]["message"]
    assert drawn.status_code == 200 and drawn.content.startswith(b"\x89PNG") and "x-prediction" not in drawn.headers


class Misbehaving:
    """A backend over the real repository whose models are loading, refuse work, or never answer."""

    def __init__(self, behaviour: str):
        self.entries, self.problems = servable(REPO)
        self.behaviour, self.generation = behaviour, 0

    async def start(self) -> None:
        pass

    async def loaded(self) -> None:
        pass

    def problem(self) -> None:
        return None

    def status(self) -> dict[str, ModelStatus]:
        ready = self.behaviour != "loading"
        return {e.key: ModelStatus(ready=ready, provider="CPUExecutionProvider" if ready else None)
                for e in self.entries}

    @contextmanager
    def records(self, model: str, kind: str, n: int):
        yield Lease(np.zeros(n, record_dtype(next(e for e in self.entries if e.key == model), kind)))

    @contextmanager
    def preparing(self, model: str):
        yield

    def run_here(self, model, lease, top_k, trace=None) -> bool:
        return False

    async def run(self, model, lease, top_k, jpegs=None, shared=None) -> None:
        if self.behaviour == "overloaded":
            raise overloaded("no room", 7)
        if self.behaviour == "broken":
            raise RuntimeError("a bug")
        await asyncio.sleep(3600)

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("behaviour,code,retry_after", [("loading", "model_loading", "1"),
                                                        ("overloaded", "overloaded", "7"),
                                                        ("silent", "overloaded", "1")])
def test_a_backend_that_cannot_answer_gives_503_with_retry_after(behaviour, code, retry_after):
    # (the request timeout on a real server, its queue behind it: tests/test_request_timeout.py)
    settings = Settings(model_repository=REPO, request_timeout_s=0.2)
    app = create_app(settings, Misbehaving(behaviour), metrics=Metrics())
    ready, classified = asyncio.run(call(app, [("GET", "/health/ready", {}),
                                               ("POST", "/classify", {"files": {"file": ("a.jpg", JPEG)}})]))
    assert ready.status_code == (503 if behaviour == "loading" else 200)
    assert classified.status_code == 503 and classified.headers["Retry-After"] == retry_after
    assert classified.json()["error"]["code"] == code


@pytest.mark.parametrize("detector", ["missing", "corrupt"])
def test_without_a_face_detector_the_service_serves_and_face_detection_answers_503(tmp_path, detector):
    (tmp_path / "expression-vit").symlink_to(REPO / "expression-vit")
    if detector == "corrupt":
        shutil.copytree(REPO / "mtcnn", tmp_path / "mtcnn")
        with open(tmp_path / "mtcnn" / "onet.onnx", "r+b") as f:
            f.write(b"garbage")
    settings = Settings(model_repository=tmp_path, warmup_runs=0)
    app = create_app(settings, LocalBackend(settings, Metrics()), metrics=Metrics())
    photo = {"files": {"file": ("a.png", photo_bytes("astronaut", "PNG"))}}
    detected, aligned, models = asyncio.run(call(app, [
        ("POST", "/expression", photo), ("POST", "/expression", {**photo, "params": {"detect": "false"}}),
        ("GET", "/models", {})]))
    assert detected.status_code == 503 and detected.json()["error"]["code"] == "face_detection_unavailable"
    why = "python -m export mtcnn" if detector == "missing" else "onet.onnx does not match the sha256"
    assert why in detected.json()["error"]["message"] and "detect=false" in detected.json()["error"]["message"]
    assert models.json()["face_detector"]["name"] is None and why in models.json()["face_detector"]["error"]
    (face,) = aligned.json()["faces"]
    assert aligned.status_code == 200 and face["box"] == [0, 0, 512, 512] and face["landmarks"] is None


def test_the_default_expression_model_is_a_setting_checked_at_start_up():
    settings = Settings(model_repository=REPO, warmup_runs=0, default_expression_model="expression-vit")
    photo = {"files": {"file": ("a.jpg", photo_bytes("astronaut", "JPEG"))}}
    expressed, models = asyncio.run(call(create_app(settings, LocalBackend(settings, Metrics()), metrics=Metrics()),
                                         [("POST", "/expression", photo), ("GET", "/models", {})]))
    assert expressed.json()["model"] == models.json()["default_expression_model"] == "expression-vit"
    wrong = Settings(model_repository=REPO, warmup_runs=0, default_expression_model="shapes-vit")
    with pytest.raises(RepositoryError, match="VITSERVE_DEFAULT_EXPRESSION_MODEL=shapes-vit is not an expression"):
        asyncio.run(call(create_app(wrong, LocalBackend(wrong, Metrics()), metrics=Metrics()), []))


def test_the_hot_routes_answer_as_fastapis_routing_would():
    """/classify and /v2/.../infer skip FastAPI's routing (hot_routes.py): they are counted under the same route
    templates, a bad query gets the same 422, errors keep their shapes (an unexpected one is a JSON 500 too), and a
    method they do not serve is FastAPI's 405."""
    def infer(path: str) -> tuple[str, str, dict]:
        return "POST", path, {"json": {"inputs": [{"name": "images", "shape": [1, 96, 96, 3], "datatype": "UINT8",
                                                   "data": [0] * (96 * 96 * 3)}]}}

    settings = Settings(model_repository=REPO, warmup_runs=0)
    metrics = Metrics()
    app = create_app(settings, LocalBackend(settings, metrics), metrics=metrics)
    photo = {"files": {"file": ("a.jpg", JPEG)}}
    answers = asyncio.run(call(app, [
        ("POST", "/classify", {**photo, "params": {"model": "shapes-vit", "top_k": 2}}),
        ("POST", "/classify", {**photo, "params": {"top_k": 0}}),
        ("POST", "/classify", {**photo, "params": {"attention": "maybe"}}),
        ("POST", "/classify", {**photo, "params": {"model": "nope"}}),
        ("GET", "/classify", {}),
        infer("/v2/models/shapes-vit/infer"), infer("/v2/models/shapes-vit/versions/1/infer"),
        infer("/v2/models/nope/infer"), infer("/v2/models/shapes-vit/versions/9/infer")]))
    ok, zero, maybe, unknown, get, v2, versioned, v2_unknown, v2_version = answers
    assert ok.status_code == 200 and len(ok.json()["results"][0]["predictions"]) == 2
    for r, field in ((zero, "query.top_k"), (maybe, "query.attention")):
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", r.text
        assert r.json()["error"]["message"].startswith(f"{field}: "), r.text
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert get.status_code == 405 and get.json()["error"]["code"] == "method_not_allowed"
    assert v2.status_code == versioned.status_code == 200 and v2.json()["outputs"] == versioned.json()["outputs"]
    for r in (v2_unknown, v2_version):  # the Open Inference Protocol's error shape under /v2
        assert r.status_code == 404 and isinstance(r.json()["error"], str), r.text
    page = asyncio.run(call(app, [("GET", "/metrics", {})]))[0].text
    counted = {(route, status): metric(page, "vitserve_requests_total", route=route, method="POST", status=status)
               for route, status in [("/classify", "200"), ("/classify", "422"), ("/classify", "404"),
                                     ("/v2/models/{name}/infer", "200"), ("/v2/models/{name}/infer", "404"),
                                     ("/v2/models/{name}/versions/{version_}/infer", "200"),
                                     ("/v2/models/{name}/versions/{version_}/infer", "404")]}
    assert counted == {("/classify", "200"): 1, ("/classify", "422"): 2, ("/classify", "404"): 1,
                       ("/v2/models/{name}/infer", "200"): 1, ("/v2/models/{name}/infer", "404"): 1,
                       ("/v2/models/{name}/versions/{version_}/infer", "200"): 1,
                       ("/v2/models/{name}/versions/{version_}/infer", "404"): 1}
    broken = create_app(settings, Misbehaving("broken"), metrics=Metrics())
    failed = asyncio.run(call(broken, [("POST", "/classify", photo)], raise_app_exceptions=False))[0]
    assert failed.status_code == 500 and failed.json()["error"] == {
        "code": "internal_error", "message": "the server failed: RuntimeError: a bug"}


def test_every_upload_route_treats_missing_and_repeated_images_alike():
    settings = Settings(model_repository=REPO, warmup_runs=0, max_files=2)
    app = create_app(settings, LocalBackend(settings, Metrics()), metrics=Metrics())
    routes = ["/classify", "/expression", "/attention-map"]
    two = [("file", ("a.jpg", JPEG)), ("file", ("b.jpg", JPEG))]
    answers = asyncio.run(call(app, [("POST", route, {}) for route in routes]
                               + [("POST", route, {"files": two}) for route in routes]
                               + [("POST", "/classify", {"files": [*two, ("files", ("c.jpg", JPEG))]})]))
    for r in answers[:3]:  # nothing sent: the same 400 everywhere
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_image", r.text
    assert answers[3].status_code == 200 and len(answers[3].json()["results"]) == 2  # /classify: two items
    for r in answers[4:6]:  # one-image routes: a second image is an error, not silently dropped
        assert r.status_code == 400 and r.json()["error"]["code"] == "one_image", r.text
    assert answers[6].status_code == 413 and answers[6].json()["error"]["code"] == "too_many_files", answers[6].text


def test_every_get_route_answers_head_with_the_gets_status_and_headers_and_no_body():
    """RFC 9110: a server MUST support HEAD wherever it supports GET. A route that serves only POST answers HEAD 405,
    as it answers GET."""
    settings = Settings(model_repository=REPO, warmup_runs=0)
    app = create_app(settings, LocalBackend(settings, Metrics()), metrics=Metrics())
    routes = list(iter_route_contexts(app.routes))
    sample = {"name": "shapes-vit", "version_": "1"}  # each path parameter's
    gets = sorted({r.path.format(**sample) for r in routes if "GET" in (r.methods or ())})
    posts = sorted({r.path.format(**sample) for r in routes if "POST" in (r.methods or ())} - set(gets))
    served = ["/docs", "/metrics", "/models", "/v2/models/shapes-vit/ready"]  # some that answer 200, not an error
    assert set(served) <= set(gets) and "/classify" in posts
    answers = asyncio.run(call(app, [(method, path, {}) for path in gets for method in ("GET", "HEAD", "GET")]
                               + [(method, path, {}) for path in posts for method in ("GET", "HEAD")]))
    for i, path in enumerate(gets):
        got, head, again = answers[3 * i:3 * i + 3]
        assert head.status_code == got.status_code and head.content == b"" and got.content, path
        if got.content == again.content:  # the same headers, its Content-Length included
            assert head.headers == got.headers, path
        else:  # a page that changes from one request to the next (/metrics): its length may too
            assert head.headers.keys() == got.headers.keys(), path
    assert all(answers[3 * gets.index(path)].status_code == 200 for path in served)
    for i, path in enumerate(posts):
        got, head = answers[3 * len(gets) + 2 * i:3 * len(gets) + 2 * i + 2]
        assert got.status_code == head.status_code == 405 and head.content == b"", path


def test_large_v2_json_is_parsed_off_the_event_loop_and_answers_as_small_json(monkeypatch):
    """A JSON body past INLINE_JSON_BYTES is parsed in the v2-json thread, where it holds the GIL in slices (on the
    event loop a 16 MB one held every other client for ~0.3 s): the same answers as one parsed inline."""
    from service.http.routes import kserve

    threads, parse = [], kserve.parse_request

    def recorded(*args):
        threads.append(threading.current_thread().name)
        return parse(*args)

    monkeypatch.setattr(kserve, "parse_request", recorded)
    x = np.random.default_rng(0).integers(0, 256, (4, 96, 96, 3), np.uint8)
    bodies = [{"inputs": [{"name": "images", "shape": list(b.shape), "datatype": "UINT8", "data": b.ravel().tolist()}]}
              for b in (x[:1], x)]
    assert len(json.dumps(bodies[0])) < kserve.INLINE_JSON_BYTES < len(json.dumps(bodies[1]))
    settings = Settings(model_repository=REPO, warmup_runs=0)
    small, large = asyncio.run(call(create_app(settings, LocalBackend(settings, Metrics()), metrics=Metrics()), [
        ("POST", "/v2/models/shapes-deit/infer", {"json": body}) for body in bodies]))
    assert sorted(threads) == ["MainThread", "v2-json_0"]
    logits = [np.array(next(o for o in r.json()["outputs"] if o["name"] == "logits")["data"]) for r in (small, large)]
    np.testing.assert_allclose(logits[1][:6], logits[0], atol=1e-5)
