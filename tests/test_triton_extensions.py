"""Triton's model configuration, statistics and system shared-memory extensions, on both backends, through Triton's
own clients (tritonclient.http and .grpc, tritonclient.utils.shared_memory) against the real server; and the
shared-memory regions' refusals, unit by unit."""
import os
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
import tritonclient.utils.shared_memory as shm
from service_process import ROOT, free_port, metric, model_pixels, photo_bytes, running_service, write_model
from tritonclient.utils import InferenceServerException

from service.core.errors import BadInput
from service.engine.shared_memory import Regions, SharedIO, Slice

MODEL = "shapes-deit"
KEY = {"x-api-key": "secret"}
MAX_BATCH, DELAY_MS = 8, 20


OWN_BATCHING = {"max_batch_size": 2, "max_queue_delay_ms": 0, "queue_limit": 8}  # shapes-vit's, in its manifest


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    """The embedded classifiers, shapes-vit with a batching of its own."""
    root = tmp_path_factory.mktemp("repository")
    for name in ("shapes-deit", "shapes-swin", "shapes-vit-int8"):
        write_model(root / name, ROOT / "model_repository" / name, name)
    write_model(root / "shapes-vit", ROOT / "model_repository" / "shapes-vit", "shapes-vit", batching=OWN_BATCHING)
    return root


@pytest.fixture(scope="module", params=["thread", "process"])
def served(request, repository):
    grpc_port = free_port()
    with running_service(backend=request.param, workers=2, grpc_port=grpc_port, api_key="secret",
                         model_repository=repository, max_batch_size=MAX_BATCH, max_queue_delay_ms=DELAY_MS,
                         queue_limit=64) as url:
        yield url, f"127.0.0.1:{grpc_port}"


@pytest.fixture(scope="module")
def clients(served):
    """(tritonclient.http, tritonclient.grpc) clients of the server."""
    url, grpc_target = served
    with triton_http.InferenceServerClient(url.removeprefix("http://")) as rest, \
            triton_grpc.InferenceServerClient(grpc_target) as grpc:
        yield rest, grpc


def photos(n: int) -> np.ndarray:
    return np.stack([model_pixels(ROOT / "model_repository" / MODEL, photo_bytes(name, "JPEG"))
                     for name in ("chelsea", "astronaut", "coffee", "rocket")[:n]])


def infer(client, module, x: np.ndarray, shared_input: str | None = None, shared_outputs: dict | None = None):
    tensor = module.InferInput("images", list(x.shape), "UINT8")
    if shared_input:
        tensor.set_shared_memory(shared_input, x.nbytes)
    else:
        tensor.set_data_from_numpy(x)
    outputs = []
    for name in ("logits", "cls_attention"):
        out = module.InferRequestedOutput(name)
        if name in (shared_outputs or {}):
            out.set_shared_memory(*shared_outputs[name])
        outputs.append(out)
    return client.infer(MODEL, [tensor], outputs=outputs, headers=dict(KEY))


def refused(call) -> str:
    with pytest.raises(InferenceServerException) as e:
        call()
    return f"{e.value.status()} {e.value.message()}"


# -- the model configuration ---------------------------------------------------------------------------------------

def test_the_configuration_is_what_serves_over_rest_and_grpc(served, clients):
    rest, grpc = clients
    config = rest.get_model_config(MODEL, headers=dict(KEY))
    assert config["name"] == MODEL and config["platform"] == "onnxruntime_onnx" and config["backend"] == "onnxruntime"
    assert config["max_batch_size"] == MAX_BATCH
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == DELAY_MS * 1000
    assert config["input"] == [{"name": "images", "data_type": "TYPE_UINT8", "format": "FORMAT_NHWC",
                                "dims": [96, 96, 3]}]
    assert [(o["name"], o["data_type"], o["dims"]) for o in config["output"]] == [
        ("logits", "TYPE_FP32", [6]), ("cls_attention", "TYPE_FP32", [4, 144]),
        ("dist_attention", "TYPE_FP32", [4, 144]), ("embeddings", "TYPE_FP32", [128])]
    assert config["instance_group"] == [{"name": MODEL, "kind": "KIND_CPU", "count": 1}]
    assert config["version_policy"] == {"latest": {"num_versions": 1}}
    assert config["parameters"]["provider"] == {"string_value": "CPUExecutionProvider"}
    # the same through gRPC, read with Triton's own definitions, and for the version asked for
    over_grpc = grpc.get_model_config(MODEL, headers=dict(KEY), as_json=True)["config"]
    assert over_grpc["max_batch_size"] == MAX_BATCH and over_grpc["input"][0]["data_type"] == "TYPE_UINT8"
    assert [int(d) for d in over_grpc["input"][0]["dims"]] == [96, 96, 3]
    assert over_grpc["instance_group"][0]["kind"] == "KIND_CPU"
    assert rest.get_model_config(MODEL, "1", headers=dict(KEY)) == config
    # another model: its own outputs and what runs it
    int8 = rest.get_model_config("shapes-vit-int8", headers=dict(KEY))
    assert [o["name"] for o in int8["output"]] == ["logits", "cls_attention", "embeddings"]
    assert int8["parameters"]["precision"] == {"string_value": "int8"}
    # the metadata lists the input Triton's tools send; the graph's other input is in its parameters
    metadata = rest.get_model_metadata(MODEL, headers=dict(KEY))
    assert [i["name"] for i in metadata["inputs"]] == ["images"]
    assert metadata["parameters"]["other_inputs"] == [{"name": "pixel_values", "datatype": "FP32",
                                                       "shape": [-1, 3, 96, 96]}]
    extensions = rest.get_server_metadata()["extensions"]
    assert {"model_configuration", "statistics", "system_shared_memory"} <= set(extensions)
    assert grpc.get_server_metadata(as_json=True)["extensions"] == extensions


def test_a_model_with_a_batching_of_its_own_is_batched_by_it_and_its_configuration_says_so(served, clients):
    """Six photos in one request: shapes-vit (max_batch_size 2 in its manifest) runs them in batches of 2,
    shapes-deit (the server's 8) in one; nine are more than shapes-vit's queue holds (8), not shapes-deit's (64)."""
    rest, grpc = clients
    for model, batch, delay_us in (("shapes-vit", 2, 0), (MODEL, MAX_BATCH, DELAY_MS * 1000)):
        for config in (rest.get_model_config(model, headers=dict(KEY)),
                       grpc.get_model_config(model, headers=dict(KEY), as_json=True)["config"]):
            assert int(config["max_batch_size"]) == batch, (model, config)
            assert int(config["dynamic_batching"].get("max_queue_delay_microseconds", 0)) == delay_us, model
    url, jpeg = served[0], photo_bytes("chelsea", "JPEG")

    def batch_sizes(model: str, n: int) -> list[int] | int:
        r = httpx.post(f"{url}/classify", files=[("files", (f"{i}.jpg", jpeg)) for i in range(n)],
                       params={"model": model}, headers=KEY, timeout=60)
        return [result["batch_size"] for result in r.json()["results"]] if r.status_code == 200 else r.status_code

    assert batch_sizes("shapes-vit", 6) == [2] * 6 and batch_sizes(MODEL, 6) == [6] * 6
    assert batch_sizes("shapes-vit", 9) == 413 and batch_sizes(MODEL, 9) == [8] * 8 + [1]


def test_a_bad_configuration_or_statistics_request_is_a_4xx(served, clients):
    rest, grpc = clients
    url = served[0]
    for path in ("/v2/models/no-such-model/config", "/v2/models/shapes-deit/versions/7/config",
                 "/v2/models/no-such-model/stats", "/v2/models/shapes-deit/versions/7/stats"):
        r = httpx.get(url + path, headers=KEY)
        assert r.status_code == 404 and "no model" in r.json()["error"], (path, r.text)
    assert httpx.get(f"{url}/v2/models/shapes-deit/config").status_code == 401  # the key guards them
    assert httpx.get(f"{url}/v2/models/stats").status_code == 401
    assert "NOT_FOUND" in refused(lambda: grpc.get_model_config("no-such-model", headers=dict(KEY)))
    assert "NOT_FOUND" in refused(lambda: grpc.get_inference_statistics("no-such-model", headers=dict(KEY)))
    assert "UNAUTHENTICATED" in refused(lambda: grpc.get_inference_statistics(MODEL))


# -- statistics ----------------------------------------------------------------------------------------------------

def statistics(rest, model: str = MODEL) -> dict:
    return rest.get_inference_statistics(model, headers=dict(KEY))["model_stats"][0]


def test_statistics_count_every_route_and_agree_with_the_metrics(served, clients):
    """/classify, /v2 over REST and gRPC and a failed request: Triton's counts, the same over gRPC, and the same
    again under Triton's metric names and vitserve's in /metrics (every process's, added up)."""
    url, _ = served
    rest, grpc = clients
    before, metrics_before = statistics(rest), httpx.get(f"{url}/metrics").text
    x = photos(3)
    infer(rest, triton_http, x)
    infer(grpc, triton_grpc, x[:2])
    jpeg = photo_bytes("coffee", "JPEG")
    assert httpx.post(f"{url}/classify", files={"file": ("a.jpg", jpeg)}, params={"model": MODEL},
                      headers=KEY, timeout=30).status_code == 200
    bad = httpx.post(f"{url}/classify", files={"file": ("a.jpg", jpeg[:300])}, params={"model": MODEL},
                     headers=KEY, timeout=30)
    assert bad.status_code == 400
    after = statistics(rest)
    count = lambda stats, part: stats["inference_stats"][part]["count"]  # noqa: E731
    ns = lambda stats, part: stats["inference_stats"][part]["ns"]  # noqa: E731
    assert count(after, "success") - count(before, "success") == 3
    assert count(after, "fail") - count(before, "fail") == 1
    assert after["inference_count"] - before["inference_count"] == 3 + 2 + 1
    assert after["execution_count"] - before["execution_count"] >= 3  # one batch each, at least (never shared:
    #                                                                 each request waited for the last answer)
    for part in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert count(after, part) - count(before, part) == 3 and ns(after, part) > ns(before, part), part
    # every request's time holds its queue and compute times
    spent = {part: ns(after, part) - ns(before, part) for part in ("success", "queue", "compute_infer")}
    assert spent["success"] > spent["queue"] + spent["compute_infer"] > 0
    assert abs(after["last_inference"] / 1e3 - time.time()) < 60  # ms since the epoch
    sizes = {b["batch_size"]: b for b in after["batch_stats"]}
    assert {1, 2, 3} <= set(sizes) and sum(b["compute_infer"]["count"] for b in sizes.values()) == \
        after["execution_count"]
    # gRPC reads the same figures
    over_grpc = grpc.get_inference_statistics(MODEL, headers=dict(KEY), as_json=True)["model_stats"][0]
    assert int(over_grpc["inference_count"]) == after["inference_count"]
    assert int(over_grpc["inference_stats"]["success"]["count"]) == count(after, "success")
    # /metrics: Triton's names, from the same counters
    text = httpx.get(f"{url}/metrics").text
    labels = {"model": MODEL, "version": "1"}
    assert metric(text, "nv_inference_request_success", **labels) == count(after, "success")
    assert metric(text, "nv_inference_request_failure", **labels) == count(after, "fail")
    assert metric(text, "nv_inference_count", **labels) == after["inference_count"]
    assert metric(text, "nv_inference_exec_count", **labels) == after["execution_count"]
    assert metric(text, "nv_inference_queue_duration_us", **labels) == ns(after, "queue") // 1000
    assert metric(text, "nv_inference_compute_infer_duration_us", **labels) == ns(after, "compute_infer") // 1000
    assert "# TYPE nv_inference_count counter" in text and "nv_inference_count_total" not in text
    # and vitserve's own: the images its batches ran, the requests its routes answered
    assert metric(text, "vitserve_images_total", model=MODEL) - metric(
        metrics_before, "vitserve_images_total", model=MODEL) == 6
    assert metric(text, "vitserve_batch_size_count", model=MODEL) == after["execution_count"]
    every = rest.get_inference_statistics(headers=dict(KEY))["model_stats"]
    assert {s["name"] for s in every} >= {MODEL, "shapes-swin", "shapes-vit-int8"}


# -- system shared memory ------------------------------------------------------------------------------------------

@pytest.fixture
def regions():
    """Shared memory made as tritonclient.utils.shared_memory makes it, destroyed afterwards: (name, key, handle)
    triples by what the test calls them."""
    made = {}

    def make(name: str, byte_size: int):
        key = f"/vitserve-test-{uuid.uuid4().hex[:8]}"
        made[name] = (name, key, shm.create_shared_memory_region(name, key, byte_size))
        return made[name]

    yield make
    for _, _, handle in made.values():
        shm.destroy_shared_memory_region(handle)


@pytest.mark.parametrize("module", [triton_http, triton_grpc], ids=["http", "grpc"])
def test_tensors_in_shared_memory_give_the_answers_of_the_body_bit_for_bit(clients, regions, module):
    client = clients[0] if module is triton_http else clients[1]
    x = photos(3)
    (_, in_key, in_handle), (_, out_key, out_handle) = regions("in", x.nbytes), regions("out", 3 * 6 * 4 + 64)
    shm.set_shared_memory_region(in_handle, [x])
    client.register_system_shared_memory("in", in_key, x.nbytes, headers=dict(KEY))
    client.register_system_shared_memory("out", out_key, 3 * 6 * 4, offset=64, headers=dict(KEY))
    try:
        status = client.get_system_shared_memory_status(headers=dict(KEY), **(
            {"as_json": True} if module is triton_grpc else {}))
        listed = status if module is triton_http else list(status["regions"].values())
        assert {(r["name"], r["key"], int(r["byte_size"])) for r in listed} == {
            ("in", in_key, x.nbytes), ("out", out_key, 3 * 6 * 4)}
        answer = infer(client, module, x, shared_input="in", shared_outputs={"logits": ("out", 3 * 6 * 4)})
        from_body = infer(client, module, x)
        got = shm.get_contents_as_numpy(out_handle, np.float32, [3, 6], offset=64)
        assert np.array_equal(got, from_body.as_numpy("logits"))  # bit for bit
        assert np.array_equal(answer.as_numpy("cls_attention"), from_body.as_numpy("cls_attention"))
        logits = answer.get_output("logits")  # listed, as Triton lists it: its shape, and no data here
        assert list(logits["shape"] if module is triton_http else logits.shape) == [3, 6]
        assert "data" not in logits if module is triton_http else answer.get_response().raw_output_contents[0] == b""
    finally:
        client.unregister_system_shared_memory(headers=dict(KEY))
    assert client.get_system_shared_memory_status(headers=dict(KEY), **(
        {"as_json": True} if module is triton_grpc else {})) in ([], {})


def test_bad_regions_and_slices_are_clear_400s(served, clients, regions, tmp_path):
    url, _ = served
    rest, grpc = clients
    x = photos(1)
    name, key, handle = regions("small", x.nbytes)
    register = lambda n, k, size, offset=0: httpx.post(  # noqa: E731
        f"{url}/v2/systemsharedmemory/region/{n}/register", json={"key": k, "offset": offset, "byte_size": size},
        headers=KEY)
    outside = Path("/dev/shm") / f"vitserve-link-{uuid.uuid4().hex[:8]}"
    outside.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_bytes(bytes(x.nbytes))
    try:
        cases = {
            ("/../etc/passwd", x.nbytes): "names no file",
            ("/a/b", x.nbytes): "names no file",
            (f"/{outside.name}", x.nbytes): "symbolic links are not followed",
            ("/vitserve-no-such-key", x.nbytes): "cannot be opened",
            (key, x.nbytes + 1): "too few",
        }
        for (k, size), says in cases.items():
            r = register("r", k, size)
            assert r.status_code == 400 and says in r.json()["error"], (k, r.text)
        assert register("small", key, x.nbytes).status_code == 200
        again = register("small", key, x.nbytes)
        assert again.status_code == 400 and "already registered" in again.json()["error"]
        assert "INVALID_ARGUMENT" in refused(lambda: grpc.register_system_shared_memory("small", key, 8,
                                                                                         headers=dict(KEY)))
        unknown = httpx.get(f"{url}/v2/systemsharedmemory/region/nothing/status", headers=KEY)
        assert unknown.status_code == 400 and "no shared-memory region named 'nothing'" in unknown.json()["error"]
        # requests naming what is not there, or more than it holds
        says = refused(lambda: infer(rest, triton_http, x, shared_input="nothing"))
        assert "400" in says and "no shared-memory region named 'nothing'" in says
        two = photos(2)
        says = refused(lambda: infer(rest, triton_http, two, shared_input="small"))  # 2 images, room for 1
        assert "400" in says and "the region holds" in says
        says = refused(lambda: infer(grpc, triton_grpc, x, shared_outputs={"logits": ("small", 8)}))
        assert "INVALID_ARGUMENT" in says and "too small" in says
        assert httpx.post(f"{url}/v2/systemsharedmemory/region/small/register", json={"key": key, "byte_size": 8}
                          ).status_code == 401  # the key guards them
        assert infer(rest, triton_http, x).as_numpy("logits").shape == (1, 6)  # and it serves on
    finally:
        outside.unlink()
        rest.unregister_system_shared_memory(headers=dict(KEY))


def test_a_region_in_use_is_not_unregistered_until_its_requests_are_answered(served, clients, regions):
    """A request of 64 images (the queue's limit) holds its region for several batches: unregistering it meanwhile
    is a 400, and once it is answered the region goes.

    Whether an unregister comes while the request runs is a race the host decides: the request takes 200 ms on a
    loaded 2-core host and a few ms on a fast one. So each try sends it a while after the request, and the next try
    moves that while into the window: later where it came before the request had claimed the region (the request
    then finds no region), earlier where it came after the answer (both succeed), until one lands in between. A
    server that never refuses an unregister in use fails every try."""
    url, _ = served
    rest, _ = clients
    x = np.repeat(photos(4), 16, axis=0)
    name, key, handle = regions("busy", x.nbytes)
    shm.set_shared_memory_region(handle, [x])
    body = {"inputs": [{"name": "images", "datatype": "UINT8", "shape": list(x.shape), "parameters": {
        "shared_memory_region": name, "shared_memory_byte_size": x.nbytes}}], "outputs": [{"name": "logits"}]}
    early, late, after_s = 0.0, None, 0.02  # seconds from the request's start: too early, too late, the next try's
    tries = []
    for _ in range(40):
        rest.register_system_shared_memory(name, key, x.nbytes, headers=dict(KEY))
        answers = []
        request = threading.Thread(target=lambda: answers.append(  # (tritonclient.http's gevent client is not
            httpx.post(f"{url}/v2/models/{MODEL}/infer", json=body, headers=KEY, timeout=60)))  # for a thread)
        request.start()
        time.sleep(after_s)  # (a point in the race, not a wait for something)
        r = httpx.post(f"{url}/v2/systemsharedmemory/region/{name}/unregister", headers=KEY)
        request.join()
        answer = answers[0]
        tries.append((round(after_s * 1e3, 1), r.status_code, answer.status_code))
        if r.status_code == 400:
            break
        assert r.status_code == 200, r.text  # unregistered: the request had not claimed it yet, or was answered
        if answer.status_code == 200:
            late = after_s
        else:
            assert answer.status_code == 400 and f"no shared-memory region named {name!r}" in answer.text, answer.text
            early = after_s
        after_s = after_s * 2 if late is None else (early + late) / 2
    assert r.status_code == 400 and "in use by 1 request" in r.json()["error"], tries  # (ms after the request,
    # the unregister's status, the request's)
    answered = answer.json()["outputs"][0]  # the request was answered
    assert answered["shape"] == [64, 6] and len(answered["data"]) == 64 * 6
    assert [s["name"] for s in rest.get_system_shared_memory_status(headers=dict(KEY))] == [name]
    rest.unregister_system_shared_memory(name, headers=dict(KEY))  # unused now: it goes
    assert rest.get_system_shared_memory_status(headers=dict(KEY)) == []


def test_the_extension_can_be_turned_off():
    with running_service(shared_memory="false") as url:
        r = httpx.get(f"{url}/v2/systemsharedmemory/status")
        assert r.status_code == 403 and "VITSERVE_SHARED_MEMORY" in r.json()["error"]
        assert "system_shared_memory" not in httpx.get(f"{url}/v2").json()["extensions"]


# -- the regions, unit by unit -------------------------------------------------------------------------------------

def test_regions_refuse_what_they_cannot_serve_and_count_their_users(tmp_path):
    regions = Regions(tmp_path)
    (tmp_path / "data").write_bytes(np.arange(64, dtype=np.uint8).tobytes())
    (tmp_path / "folder").mkdir()
    for key in ("", "/", "/..", "/folder/data", "/folder", "/missing"):
        with pytest.raises(BadInput):
            regions.register("r", key, 0, 8)
    with pytest.raises(BadInput, match="too few"):
        regions.register("r", "/data", 60, 8)
    regions.register("r", "/data", 16, 48)
    records = np.zeros(2, [("image", np.uint8, (2, 3, 2)), ("logits", np.float32, (2,))])
    claim = regions.claim(SharedIO(Slice("r", 8, 24), {"logits": Slice("r", 32, 16)}), records, "image")
    assert [view.tolist() for view in claim.inputs] == [
        np.arange(24, 36).reshape(2, 3, 2).tolist(), np.arange(36, 48).reshape(2, 3, 2).tolist()]
    with pytest.raises(BadInput, match="in use by 1"):
        regions.unregister("r")
    records["logits"] = [[1.5, 2.5], [3.5, 4.5]]
    claim.write(records)
    claim.release()
    assert np.frombuffer((tmp_path / "data").read_bytes()[48:64], np.float32).tolist() == [1.5, 2.5, 3.5, 4.5]
    for wrong in (SharedIO(Slice("r", 8, 23)), SharedIO(Slice("r", 40, 24)), SharedIO(Slice("q", 0, 24)),
                  SharedIO(None, {"logits": Slice("r", 0, 15)})):
        with pytest.raises(BadInput):
            regions.claim(wrong, records, "image")
    regions.unregister("r")
    assert regions.status() == [] and os.path.exists(tmp_path / "data")
