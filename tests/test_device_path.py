"""The Runner's device path (IOBinding, outputs bound and copied back, reused batch buffers) on the CPU provider:
what serves every batch on CUDA, exercised on hosts without a GPU (CI) through the `iobinding` switch."""
import asyncio
import ctypes
import json
import logging
import sys

import httpx
import numpy as np
import onnx
import pytest
import tritonclient.http as triton
from service_process import ROOT, direct_probabilities, model_pixels, photo_bytes, run_graph, running_service

from service.engine import runtime
from service.explain.maps import last_layer_grid, rollout_grid
from service.engine.backends.local import LocalBackend
from service.core.metrics import Metrics
from service.engine.runtime import CPU, Runner
from service.core.settings import Settings

REPO = ROOT / "model_repository"
# the graphs a Runner serves (a CLIP's text graph runs in a plain session of its own: the texts' batcher)
GRAPHS = sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("*/*.onnx")
                if p.parent.name != "mtcnn" and p.name != "text.onnx")
INPUTS = ("images", "pixel_values")
JPEG = photo_bytes("chelsea", "JPEG")


def inputs_of(graph: str) -> tuple[str, str]:
    """The graph's two inputs: the images and the float pixels, or for the relevance graph the images and targets."""
    return ("images", "target") if graph.endswith("/relevance.onnx") else INPUTS


def batches(graph: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """Images alone, float pixels alone, and both at once, at the graph's input size; for the relevance graph, images
    and a target each."""
    manifest = json.loads((REPO / graph).parent.joinpath("manifest.json").read_text())
    h, w = manifest["input"]["size"]
    rng = np.random.default_rng(0)
    images, pixels = rng.integers(0, 256, (3, h, w, 3), np.uint8), rng.standard_normal((2, 3, h, w), np.float32)
    if inputs_of(graph) != INPUTS:
        return [(images, np.eye(len(manifest["labels"]), dtype=np.float32)[[0, 1, 0]])]
    return [(images, pixels[:0]), (images[:0], pixels), (images, pixels)]


def assert_same_runs(device: Runner, plain: Runner, graph: str) -> None:
    for images, pixels in batches(graph):
        gathered = device.host_batch(len(images))  # as the service gathers a batch
        gathered[:] = images
        got, want = device.run(gathered, pixels), plain.run(images, pixels)
        assert list(got) == plain.output_names
        rows = len(images) if inputs_of(graph) != INPUTS else len(images) + len(pixels)  # (targets are per image)
        for name in want:
            assert len(got[name]) == rows
            np.testing.assert_array_equal(got[name], want[name])


@pytest.mark.parametrize("graph", GRAPHS)
def test_every_embedded_graph_runs_through_the_device_path_as_a_plain_run(graph):
    device = Runner(REPO / graph, inputs_of(graph), [CPU], iobinding=True)
    plain = Runner(REPO / graph, inputs_of(graph), [CPU])
    assert device.iobinding and not plain.iobinding
    assert_same_runs(device, plain, graph)


def test_a_graph_whose_inputs_have_defaults_runs_through_the_device_path(tmp_path):
    """Graphs exported on 2026-11-25/26 gave each input an empty-batch default: ONNX Runtime then lists no inputs,
    and IOBinding's numpy bind_cpu_input fails on them ("Failed to find NodeArg"). The service still serves them."""
    proto = onnx.load(REPO / "shapes-vit" / "model.onnx")
    for value in proto.graph.input:
        dims = value.type.tensor_type.shape.dim
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        proto.graph.initializer.append(onnx.numpy_helper.from_array(
            np.zeros([0, *(d.dim_value for d in dims[1:])], dtype), value.name))
    onnx.save(proto, tmp_path / "model.onnx")
    device = Runner(tmp_path / "model.onnx", INPUTS, [CPU], iobinding=True)
    assert device.session.get_inputs() == []  # the case the device path must bind all the same
    assert device.image_shape == (96, 96, 3)
    assert_same_runs(device, Runner(REPO / "shapes-vit" / "model.onnx", INPUTS, [CPU]), "shapes-vit/model.onnx")


def test_the_device_paths_batch_buffer_is_reused_per_thread_and_grows_in_powers_of_two():
    runner = Runner(REPO / "shapes-vit" / "model.onnx", INPUTS, [CPU], iobinding=True)
    first = runner.host_batch(3)
    assert first.shape == (3, 96, 96, 3) and first.dtype == np.uint8 and first.base.shape[0] == 4
    smaller = runner.host_batch(2)
    assert np.shares_memory(first, smaller)  # no allocation per batch
    grown = runner.host_batch(5)
    assert grown.base.shape[0] == 8 and not np.shares_memory(first, grown)
    plain = Runner(REPO / "shapes-vit" / "model.onnx", INPUTS, [CPU])
    assert not np.shares_memory(plain.host_batch(2), plain.host_batch(2))  # off the device path: fresh memory


def test_without_cupy_batches_are_gathered_in_pageable_memory_with_a_warning(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "cupyx", None)  # an import of it fails, as where CuPy is not installed
    runtime.pinned_empty.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="vitserve"):
            assert runtime.pinned_empty() is None
        assert "page-locked memory needs CuPy" in caplog.text
    finally:
        runtime.pinned_empty.cache_clear()


def plain_path_grids(model_dir, image: bytes) -> dict[tuple[str, str], np.ndarray]:
    """The attention grids GET /attention-map gives for an image, from plain ONNX Runtime sessions (no IOBinding)
    of the model's graph and of its explain graph on the service's preprocessing, by (method, head)."""
    manifest = json.loads((model_dir / "manifest.json").read_text())
    attention, pixels = manifest["attention"], model_pixels(model_dir, image)[None]

    def outputs(graph: str) -> dict[str, np.ndarray]:  # the one image's row of each output, by name
        names = [o.name for o in onnx.load(model_dir / graph, load_external_data=False).graph.output]
        return {name: value[0] for name, value in zip(names, run_graph(model_dir / graph, pixels))}

    main, explained = outputs("model.onnx"), outputs(manifest["files"]["explain"]["path"])
    layers = [explained[name] for name in attention["explain_outputs"]]
    return {(method, head): grid(head) for head in ("mean", "max", "0") for method, grid in (
        ("last", lambda h: last_layer_grid(main, attention, "cls", h)),
        ("rollout", lambda h: rollout_grid(layers, attention, "cls", h)))}


@pytest.mark.parametrize("backend", ["process"])  # the backend that serves on CUDA
def test_the_service_serves_classify_v2_and_attention_maps_through_the_device_path(backend):
    with running_service(backend=backend, workers=1, iobinding="true") as url:
        r = httpx.post(f"{url}/classify", files={"file": ("chelsea.jpg", JPEG)},
                       params={"model": "shapes-vit", "top_k": 6, "attention": "true"}, timeout=30)
        assert r.status_code == 200, r.text
        (result,) = r.json()["results"]
        got = {p["index"]: p["score"] for p in result["predictions"]}
        np.testing.assert_allclose([got[i] for i in range(6)], direct_probabilities(REPO / "shapes-vit", JPEG),
                                   atol=1e-5)
        plain = plain_path_grids(REPO / "shapes-vit", JPEG)
        for (method, head), want in plain.items():  # rollout runs the explain graph
            m = httpx.get(f"{url}/attention-map", params={"id": result["id"], "method": method, "head": head,
                                                            "format": "json"})
            assert m.status_code == 200, m.text
            # the device path's outputs are the plain run's bit for bit (the tests above); the JSON rounds to 4
            # places, and the server's threads may sum in another order: a map of another image, or of stale rows
            # of the reused batch buffer, is tenths apart
            np.testing.assert_allclose(m.json()["grid"], want, atol=2e-4, err_msg=f"{method}, head {head}")
        client = triton.InferenceServerClient(url=url.removeprefix("http://"))
        pixels = model_pixels(REPO / "shapes-vit", JPEG)[None]
        images = triton.InferInput("images", list(pixels.shape), "UINT8")
        images.set_data_from_numpy(pixels)
        logits = client.infer("shapes-vit", [images]).as_numpy("logits")
        probs = np.exp(logits[0] - logits[0].max())
        np.testing.assert_allclose(probs / probs.sum(), direct_probabilities(REPO / "shapes-vit", JPEG), atol=1e-5)


def test_cuda_blocking_sync_sets_the_primary_contexts_flag_before_any_session_and_says_why_it_cannot(monkeypatch):
    """CU_CTX_SCHED_BLOCKING_SYNC on device 0's primary context, through the driver API in its order (cuInit
    first); on a host without libcuda, the reason, not an exception."""
    calls = []

    class Driver:
        def __getattr__(self, name):
            def call(*args):
                calls.append((name, [getattr(a, "value", None) if not isinstance(a, int) else a for a in args]))
                return 0
            return call

    monkeypatch.setattr(runtime.ctypes, "CDLL", lambda name: Driver() if name == "libcuda.so.1" else None)
    assert runtime.cuda_blocking_sync() is None
    assert [name for name, _ in calls] == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxSetFlags_v2"]
    assert calls[0][1] == [0] and calls[1][1][1] == 0 and calls[2][1] == [0, 0x04]

    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(runtime.ctypes, "CDLL", missing)
    assert "no CUDA driver" in runtime.cuda_blocking_sync()


def libcuda_loads() -> bool:
    """Whether the CUDA driver's library loads here, as cuda_blocking_sync loads it (a GPU host's driver)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(libcuda_loads(), reason="libcuda.so.1 loads on this host: cuda_blocking_sync goes on to the "
                                            "driver calls, so the no-driver warning this test waits for never comes "
                                            "(the driver calls' order: the test above)")
def test_with_cuda_blocking_sync_on_a_host_without_cuda_the_models_serve_and_the_log_says_why(caplog):
    async def main() -> dict:
        backend = LocalBackend(Settings(model_repository=REPO, cuda_blocking_sync=True, warmup_runs=0), Metrics())
        await backend.start()
        await backend.loaded()
        await backend.close()
        return backend.status()

    with caplog.at_level(logging.WARNING, "vitserve"):
        status = asyncio.run(main())
    assert all(s.ready for s in status.values())
    assert "VITSERVE_CUDA_BLOCKING_SYNC is not applied: no CUDA driver" in caplog.text
