"""Who may use system shared memory (VITSERVE_SHARED_MEMORY): by default (`local`) only a client on this host, over
REST and gRPC alike: its routes and RPCs, and a request whose tensors name a region. The service runs in this process
and each client's address is set in-process (httpx's ASGITransport, a fake gRPC context): no test traffic goes to
an address that is not loopback."""
import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable

import grpc
import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from service_process import ROOT

from service.http.app import create_app
from service.engine.backends.local import LocalBackend
from service.protocol.grpc_server import InferenceService, peer_host
from service.core.metrics import Metrics
from service.protocol.open_inference import shared_memory_refusal
from service.protocol import open_inference_pb2 as pb
from service.core.settings import Settings
from service.engine.shared_memory import SHM, local_client

MODEL = "shapes-deit"
H, W = json.loads((ROOT / "model_repository" / MODEL / "manifest.json").read_text())["input"]["size"]
IMAGE_BYTES, LOGITS_BYTES = H * W * 3, 6 * 4  # the region: the image, then room for its logits
REMOTE, REMOTE_PEER = ("10.1.2.3", 40000), "ipv4:10.1.2.3:5555"
LOOPBACK, LOOPBACK_PEER = ("127.0.0.1", 40000), "ipv4:127.0.0.1:5555"
UNWRITTEN = b"\xab" * LOGITS_BYTES
EXTENSION = "system_shared_memory"


@pytest.fixture
def shm_file():
    """A /dev/shm file holding an image, then bytes no float32 logits are: (key, path, image)."""
    key = f"/vitserve-access-{uuid.uuid4().hex}"
    path = SHM / key[1:]
    image = np.random.default_rng(0).integers(0, 256, (1, H, W, 3), np.uint8)
    path.write_bytes(image.tobytes() + UNWRITTEN)
    yield key, path, image
    path.unlink()


def serving(tmp_path, scenario: Callable[[FastAPI, InferenceService], Awaitable[None]], **settings) -> None:
    """`scenario` run with the app over a repository of one model, started, and a gRPC servicer over its
    pipelines."""
    repository = tmp_path / "repository"
    repository.mkdir()
    (repository / MODEL).symlink_to(ROOT / "model_repository" / MODEL)
    config = Settings(model_repository=repository, warmup_runs=0, **settings)
    app = create_app(config, LocalBackend(config, Metrics()), metrics=Metrics())

    async def started() -> None:
        async with app.router.lifespan_context(app):
            await app.state.pipelines.backend.loaded()
            await scenario(app, InferenceService(app.state.pipelines, config, app.state.metrics))

    asyncio.run(started())


def rest(app, client: tuple[str, int] | None) -> httpx.AsyncClient:
    """A client of the app from `client`'s address (None: no address, as uvicorn gives a Unix-socket peer)."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=client), base_url="http://vitserve")


class Aborted(Exception):
    pass


class Context:
    """What the servicer asks of a call's context: its peer, as gRPC writes it, metadata, the time its deadline
    leaves (none here) and abort."""

    def __init__(self, peer: str):
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple:
        return ()

    def time_remaining(self) -> float | None:
        return None

    async def abort(self, code: grpc.StatusCode, message: str, trailing_metadata=()) -> None:
        raise Aborted(code, message)


async def code_of(call) -> grpc.StatusCode:
    try:
        await call
    except Aborted as e:
        return e.args[0]
    return grpc.StatusCode.OK


def region(key: str) -> dict:
    return {"key": key, "offset": 0, "byte_size": IMAGE_BYTES + LOGITS_BYTES}


def register_request(key: str) -> pb.SystemSharedMemoryRegisterRequest:
    return pb.SystemSharedMemoryRegisterRequest(name="r", **region(key))


def in_region(byte_size: int, offset: int = 0) -> dict:
    """A tensor's parameters that put it in region r."""
    return {"shared_memory_region": "r", "shared_memory_byte_size": byte_size, "shared_memory_offset": offset}


def infer_body(image: np.ndarray, shared_input: bool, shared_output: bool) -> dict:
    tensor = {"name": "images", "shape": list(image.shape), "datatype": "UINT8"}
    tensor |= {"parameters": in_region(IMAGE_BYTES)} if shared_input else {"data": image.ravel().tolist()}
    logits = {"name": "logits"} | ({"parameters": in_region(LOGITS_BYTES, IMAGE_BYTES)} if shared_output else {})
    return {"inputs": [tensor], "outputs": [logits]}


def infer_request(image: np.ndarray, shared_input: bool, shared_output: bool) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=MODEL)
    tensor = request.inputs.add(name="images", datatype="UINT8", shape=image.shape)
    logits = request.outputs.add(name="logits")
    if shared_input:
        put_in_region(tensor.parameters, IMAGE_BYTES)
    else:
        request.raw_input_contents.append(image.tobytes())
    if shared_output:
        put_in_region(logits.parameters, LOGITS_BYTES, IMAGE_BYTES)
    return request


def put_in_region(parameters, byte_size: int, offset: int = 0) -> None:
    for name, value in in_region(byte_size, offset).items():
        setattr(parameters[name], "string_param" if isinstance(value, str) else "int64_param", value)


def written_logits(path) -> bytes:
    return path.read_bytes()[IMAGE_BYTES:]


async def region_answers(client: httpx.AsyncClient, key: str) -> list[httpx.Response]:
    """Each of the regions' routes once: register region r, list all, list r, unregister r, unregister all."""
    return [await client.post("/v2/systemsharedmemory/region/r/register", json=region(key)),
            await client.get("/v2/systemsharedmemory/status"),
            await client.get("/v2/systemsharedmemory/region/r/status"),
            await client.post("/v2/systemsharedmemory/region/r/unregister"),
            await client.post("/v2/systemsharedmemory/unregister")]


def test_rest_refuses_a_client_not_on_this_host_its_regions_and_requests_that_name_one(tmp_path, shm_file):
    key, path, image = shm_file

    async def scenario(app: FastAPI, service: InferenceService) -> None:
        async with rest(app, REMOTE) as remote, rest(app, LOOPBACK) as local:
            for answer in await region_answers(remote, key):
                assert answer.status_code == 403, answer.request.url
                assert "10.1.2.3" in answer.json()["error"] and "VITSERVE_SHARED_MEMORY" in answer.json()["error"]
            assert (await local.get("/v2/systemsharedmemory/status")).json() == []  # nothing registered
            assert (await local.post("/v2/systemsharedmemory/region/r/register", json=region(key))).status_code == 200
            refused = [await remote.get("/v2/systemsharedmemory/status"),
                       await remote.post("/v2/systemsharedmemory/region/r/unregister"),
                       await remote.post("/v2/systemsharedmemory/unregister"),
                       *[await remote.post(f"/v2/models/{MODEL}/infer", json=infer_body(image, *shared))
                         for shared in ((True, False), (False, True), (True, True))]]
            assert [r.status_code for r in refused] == [403] * 6, [r.text for r in refused]
            assert [r["name"] for r in (await local.get("/v2/systemsharedmemory/status")).json()] == ["r"]
            assert written_logits(path) == UNWRITTEN
            in_body = await remote.post(f"/v2/models/{MODEL}/infer", json=infer_body(image, False, False))
            assert in_body.status_code == 200  # the refusal is shared memory's alone
            assert EXTENSION not in (await remote.get("/v2")).json()["extensions"]
            assert EXTENSION in (await local.get("/v2")).json()["extensions"]
            shared = await local.post(f"/v2/models/{MODEL}/infer", json=infer_body(image, True, True))
            assert shared.status_code == 200, shared.text
            want = next(o["data"] for o in in_body.json()["outputs"] if o["name"] == "logits")
            np.testing.assert_allclose(np.frombuffer(written_logits(path), "<f4"), want, atol=1e-5)
            assert (await local.post("/v2/systemsharedmemory/unregister")).status_code == 200

    serving(tmp_path, scenario)


def test_grpc_refuses_a_peer_not_on_this_host_its_regions_and_requests_that_name_one(tmp_path, shm_file):
    key, path, image = shm_file
    remote, local = Context(REMOTE_PEER), Context(LOOPBACK_PEER)
    register = register_request(key)
    status, unregister = pb.SystemSharedMemoryStatusRequest(), pb.SystemSharedMemoryUnregisterRequest()

    async def stream(request: pb.ModelInferRequest):
        yield request

    async def scenario(app: FastAPI, service: InferenceService) -> None:
        denied = [await code_of(service.SystemSharedMemoryRegister(register, remote)),
                  await code_of(service.SystemSharedMemoryStatus(status, remote)),
                  await code_of(service.SystemSharedMemoryUnregister(unregister, remote))]
        assert denied == [grpc.StatusCode.PERMISSION_DENIED] * 3
        assert not (await service.SystemSharedMemoryStatus(status, local)).regions  # nothing registered
        await service.SystemSharedMemoryRegister(register, local)
        denied = [await code_of(service.SystemSharedMemoryStatus(status, remote)),
                  await code_of(service.SystemSharedMemoryUnregister(unregister, remote)),
                  *[await code_of(service.ModelInfer(infer_request(image, *shared), remote))
                    for shared in ((True, False), (False, True), (True, True))]]
        assert denied == [grpc.StatusCode.PERMISSION_DENIED] * 5
        (streamed,) = [r async for r in service.ModelStreamInfer(stream(infer_request(image, True, True)), remote)]
        assert "VITSERVE_SHARED_MEMORY" in streamed.error_message
        assert list((await service.SystemSharedMemoryStatus(status, local)).regions) == ["r"]
        assert written_logits(path) == UNWRITTEN
        in_body = await service.ModelInfer(infer_request(image, False, False), remote)
        metadata = pb.ServerMetadataRequest()
        assert EXTENSION not in (await service.ServerMetadata(metadata, remote)).extensions
        assert EXTENSION in (await service.ServerMetadata(metadata, local)).extensions
        await service.ModelInfer(infer_request(image, True, True), local)
        np.testing.assert_allclose(np.frombuffer(written_logits(path), "<f4"),
                                   np.frombuffer(in_body.raw_output_contents[0], "<f4"), atol=1e-5)
        await service.SystemSharedMemoryUnregister(unregister, local)

    serving(tmp_path, scenario)


def test_loopback_of_every_form_and_a_unix_socket_are_on_this_host(tmp_path, shm_file):
    key, _, _ = shm_file
    clients = [(("127.0.0.1", 1), "ipv4:127.0.0.1:5555"), (("127.8.9.10", 1), "ipv4:127.8.9.10:5555"),
               (("::1", 1), "ipv6:%5B::1%5D:5555"), (("::ffff:127.0.0.1", 1), "ipv6:%5B::ffff:127.0.0.1%5D:5555"),
               (None, "unix:/run/vitserve.sock")]

    async def scenario(app: FastAPI, service: InferenceService) -> None:
        for address, peer in clients:
            async with rest(app, address) as client:
                answers = await region_answers(client, key)
            assert [r.status_code for r in answers] == [200] * 5, (address, answers[0].text)
            assert answers[1].json()[0]["key"] == key
            await service.SystemSharedMemoryRegister(register_request(key), Context(peer))
            regions = await service.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(), Context(peer))
            assert regions.regions["r"].key == key, peer
            await service.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(), Context(peer))

    serving(tmp_path, scenario)


def test_any_lets_a_client_not_on_this_host_map_regions(tmp_path, shm_file):
    key, path, image = shm_file

    async def scenario(app: FastAPI, service: InferenceService) -> None:
        async with rest(app, REMOTE) as remote:
            answers = await region_answers(remote, key)
            assert [r.status_code for r in answers] == [200] * 5, answers[0].text
            assert EXTENSION in (await remote.get("/v2")).json()["extensions"]
            await service.SystemSharedMemoryRegister(register_request(key), Context(REMOTE_PEER))
            inferred = await service.ModelInfer(infer_request(image, True, True), Context(REMOTE_PEER))
            assert written_logits(path) != UNWRITTEN and inferred.raw_output_contents[0] == b""
            shared = await remote.post(f"/v2/models/{MODEL}/infer", json=infer_body(image, True, True))
            assert shared.status_code == 200, shared.text

    serving(tmp_path, scenario, shared_memory="any")


def test_false_refuses_every_client_as_before(tmp_path, shm_file):
    key, path, image = shm_file

    async def scenario(app: FastAPI, service: InferenceService) -> None:
        async with rest(app, LOOPBACK) as local:
            answers = await region_answers(local, key)
            assert [r.status_code for r in answers] == [403] * 5
            assert all("VITSERVE_SHARED_MEMORY=false" in r.json()["error"] for r in answers)
            refused = await local.post(f"/v2/models/{MODEL}/infer", json=infer_body(image, False, True))
            assert refused.status_code == 403 and "VITSERVE_SHARED_MEMORY=false" in refused.json()["error"]
            assert EXTENSION not in (await local.get("/v2")).json()["extensions"]
            for peer in (LOOPBACK_PEER, "unix:"):
                assert await code_of(service.SystemSharedMemoryRegister(register_request(key), Context(peer))) \
                    == grpc.StatusCode.PERMISSION_DENIED
                assert await code_of(service.ModelInfer(infer_request(image, False, True), Context(peer))) \
                    == grpc.StatusCode.PERMISSION_DENIED
            assert written_logits(path) == UNWRITTEN

    serving(tmp_path, scenario, shared_memory="false")


@pytest.mark.parametrize("host,local", [
    ("127.0.0.1", True), ("127.255.0.1", True), ("::1", True), ("::ffff:127.0.0.1", True), (None, True),
    ("10.1.2.3", False), ("172.17.0.1", False), ("::ffff:10.1.2.3", False), ("2001:db8::1", False), ("::", False),
    ("0.0.0.0", False), ("testclient", False), ("", False)])
def test_a_client_is_local_by_its_loopback_address_or_a_unix_socket(host, local):
    assert local_client(host) is local
    refusal = shared_memory_refusal("local", host)
    assert (refusal is None) is local and (local or refusal.code == "shared_memory_not_local")
    assert shared_memory_refusal("any", host) is None
    assert shared_memory_refusal("false", host).code == "shared_memory_off"


@pytest.mark.parametrize("peer,host", [
    ("ipv4:127.0.0.1:5555", "127.0.0.1"), ("ipv6:%5B::1%5D:5555", "::1"), ("ipv6:[::1]:5555", "::1"),
    ("ipv6:%5B::ffff:127.0.0.1%5D:5555", "::ffff:127.0.0.1"), ("ipv4:10.1.2.3:5555", "10.1.2.3"),
    ("unix:/run/vitserve.sock", None), ("unix:", None), ("unix-abstract:vitserve", None),
    ("vsock:3:5555", "vsock:3:5555")])
def test_a_grpc_peer_gives_its_address(peer, host):
    assert peer_host(peer) == host


@pytest.mark.parametrize("given,mode", [("local", "local"), ("any", "any"), ("false", "false"), ("true", "local"),
                                        ("True", "local"), ("0", "false"), (True, "local"), (False, "false")])
def test_the_setting_reads_an_old_true_as_local(monkeypatch, given, mode):
    assert Settings(shared_memory=given).shared_memory == mode
    monkeypatch.setenv("VITSERVE_SHARED_MEMORY", str(given))
    assert Settings().shared_memory == mode


def test_the_default_is_local(monkeypatch):
    monkeypatch.delenv("VITSERVE_SHARED_MEMORY", raising=False)
    assert Settings(_env_file=None).shared_memory == "local"
