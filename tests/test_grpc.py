"""The Open Inference Protocol over gRPC, on both backends: Triton's own client (tritonclient.grpc) against the
real server on loopback; the same answers as a direct session and the REST route; errors as status codes;
overload, cancellation, batches shared with REST clients, and Triton's stream."""
import asyncio
import io
import json
import queue
import time

import grpc
import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as triton
import tritonclient.http as triton_http
from fault_graphs import stalling, turns_for
from PIL import Image
from service_process import ROOT, free_port, metric, model_pixels, photo_bytes, run_graph, running_service
from skimage import data as photos
from tritonclient.utils import InferenceServerException

from repository import InputPolicy
from service.protocol.grpc_server import SERVICE
from service.protocol import open_inference_pb2 as pb

KEY = {"x-api-key": "secret"}  # tritonclient adds to the headers it is given: each call gets a copy
MODEL = "shapes-deit"
QUEUE_LIMIT = 64


@pytest.fixture(scope="module", params=["thread", "process"])
def served(request):
    port = free_port()
    with running_service(backend=request.param, workers=2, grpc_port=port, api_key="secret", max_batch_size=8,
                         queue_limit=QUEUE_LIMIT, max_queue_delay_ms=500) as url:
        yield url, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(served):
    with triton.InferenceServerClient(served[1]) as c:
        yield c


def images(n: int) -> np.ndarray:
    return np.stack([model_pixels(ROOT / "model_repository" / MODEL, photo_bytes(name, "JPEG"))
                     for name in ("chelsea", "astronaut", "coffee", "rocket")[:n]])


def normalised(x: np.ndarray) -> np.ndarray:
    return InputPolicy.from_manifest(json.loads((ROOT / "model_repository" / MODEL / "manifest.json").read_text())[
        "input"]).normalise(x)


def infer(client: triton.InferenceServerClient, x: np.ndarray, name: str, outputs: list[str] | None = None,
          model: str = MODEL, headers: dict | None = KEY) -> triton.InferResult:
    tensor = triton.InferInput(name, list(x.shape), "UINT8" if x.dtype == np.uint8 else "FP32")
    tensor.set_data_from_numpy(x)
    asked = [triton.InferRequestedOutput(o) for o in outputs] if outputs else None
    return client.infer(model, [tensor], outputs=asked, headers=dict(headers or {}))


def status_of(call) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as e:
        call()
    return e.value.status(), e.value.message()


def test_both_inputs_give_a_direct_sessions_answers_and_the_rest_routes(served, client):
    x = images(3)
    want = run_graph(ROOT / "model_repository" / MODEL / "model.onnx", x)
    got = infer(client, x, "images")
    np.testing.assert_allclose(got.as_numpy("logits"), want[0], atol=1e-5)
    assert {o.name for o in got.get_response().outputs} == {"logits", "cls_attention", "dist_attention", "embeddings"}
    pixels = normalised(x)
    only_logits = infer(client, pixels, "pixel_values", outputs=["logits"])
    assert [o.name for o in only_logits.get_response().outputs] == ["logits"]
    np.testing.assert_allclose(only_logits.as_numpy("logits"), want[0], atol=1e-4)
    only_embeddings = infer(client, x, "images", outputs=["embeddings"])  # the image embedding, asked for alone
    assert [o.name for o in only_embeddings.get_response().outputs] == ["embeddings"]
    np.testing.assert_allclose(only_embeddings.as_numpy("embeddings"), want[3], atol=1e-5)
    with triton_http.InferenceServerClient(served[0].removeprefix("http://")) as rest:
        tensor = triton_http.InferInput("images", list(x.shape), "UINT8")
        tensor.set_data_from_numpy(x)
        np.testing.assert_array_equal(rest.infer(MODEL, [tensor], headers=dict(KEY)).as_numpy("logits"),
                                      got.as_numpy("logits"))


def test_relevance_maps_over_grpc_and_rest_take_a_target_row_per_image(served, client):
    """The relevance outputs as a Triton client asks for them: the images and a `target` input (a weight vector over
    the classes per image), through either backend; equal to the relevance graph run directly."""
    x = images(3)
    target = np.zeros((3, 6), np.float32)
    target[1, 2], target[2] = 1, np.linspace(-1, 1, 6)  # the top label, one label, a weight vector
    want = ort.InferenceSession(ROOT / "model_repository" / MODEL / "relevance.onnx",
                                providers=["CPUExecutionProvider"]).run(None, {"images": x, "target": target})

    def sent(module) -> list:
        tensors = [module.InferInput("images", list(x.shape), "UINT8"), module.InferInput("target", [3, 6], "FP32")]
        for tensor, value in zip(tensors, (x, target)):
            tensor.set_data_from_numpy(value)
        return tensors

    got = client.infer(MODEL, sent(triton), outputs=[triton.InferRequestedOutput("relevance")], headers=dict(KEY))
    assert [o.name for o in got.get_response().outputs] == ["relevance"]
    scale = np.abs(want[1]).max(axis=-1, keepdims=True)
    assert np.abs((got.as_numpy("relevance") - want[1]) / scale).max() < 1e-5
    with triton_http.InferenceServerClient(served[0].removeprefix("http://")) as rest:
        both = rest.infer(MODEL, sent(triton_http), headers=dict(KEY))
        np.testing.assert_allclose(both.as_numpy("logits"), want[0], atol=1e-5)
        np.testing.assert_array_equal(both.as_numpy("relevance"), got.as_numpy("relevance"))
        io = rest.get_model_metadata(MODEL, headers=dict(KEY))["parameters"]["relevance"]
        assert (io["rule"], io["input"]["name"], io["outputs"][1]["shape"]) == ("chefer2021", "target", [-1, 2, 144])
    wrong = triton.InferInput("target", [3, 5], "FP32")
    wrong.set_data_from_numpy(target[:, :5].copy())
    code, message = status_of(lambda: client.infer(MODEL, [sent(triton)[0], wrong], headers=dict(KEY)))
    assert code == "StatusCode.INVALID_ARGUMENT" and "FP32 [-1, 6]" in message
    code, message = status_of(lambda: infer(client, x, "images", outputs=["relevance"]))
    assert code == "StatusCode.INVALID_ARGUMENT" and "send the input 'target'" in message


def both_inputs(module, x: np.ndarray, pixels: np.ndarray, binary: bool = True) -> list:
    """`images` and `pixel_values` as tritonclient's (http or grpc) inputs."""
    tensors = [module.InferInput("images", list(x.shape), "UINT8"),
               module.InferInput("pixel_values", list(pixels.shape), "FP32")]
    for tensor, value in zip(tensors, (x, pixels)):
        tensor.set_data_from_numpy(value, **({"binary_data": binary} if module is triton_http else {}))
    return tensors


def test_both_of_the_graphs_inputs_at_once_give_the_graphs_rows_images_first(served, client):
    """A client that sends both of the graph's inputs: B1 images and B2 pixel values (either may be empty) get the
    B1 + B2 rows a plain session computes for both, the images' first, over REST (JSON and binary), ModelInfer
    and ModelStreamInfer."""
    photos4 = images(4)
    x, pixels = photos4[:2], normalised(photos4[2:])  # different photos, so that a swapped row shows
    session = ort.InferenceSession(ROOT / "model_repository" / MODEL / "model.onnx",
                                   providers=["CPUExecutionProvider"])
    listed = [i["name"] for i in client.get_model_metadata(MODEL, headers=dict(KEY), as_json=True)["inputs"]]
    assert listed == ["images"]  # what Triton's tools send; pixel_values is in the REST metadata's parameters
    cases = [(x, pixels), (x[:0], pixels), (x, pixels[:0])]
    with triton_http.InferenceServerClient(served[0].removeprefix("http://")) as rest:
        for images_, pixels_ in cases:
            want = dict(zip([o.name for o in session.get_outputs()],
                            session.run(None, {"images": images_, "pixel_values": pixels_})))
            assert len(want["logits"]) == len(images_) + len(pixels_)
            answers = [client.infer(MODEL, both_inputs(triton, images_, pixels_), headers=dict(KEY))]
            answers += [rest.infer(MODEL, both_inputs(triton_http, images_, pixels_, binary), headers=dict(KEY))
                        for binary in (True, False)]
            streamed = queue.Queue()
            client.start_stream(callback=lambda result, error: streamed.put((result, error)), headers=dict(KEY))
            try:
                client.async_stream_infer(MODEL, both_inputs(triton, images_, pixels_))
                result, error = streamed.get(timeout=30)
            finally:
                client.stop_stream()
            assert error is None, error
            for answer in [*answers, result]:
                for name, value in want.items():
                    np.testing.assert_allclose(answer.as_numpy(name), value, atol=1e-4, err_msg=name)


def test_inputs_sent_twice_or_no_image_at_all_are_refused_and_both_inputs_count_against_the_queue(served, client):
    x, pixels = images(1), normalised(images(1))
    both_empty = both_inputs(triton, x[:0], pixels[:0])
    twice = both_inputs(triton, x, pixels)[:1] * 2
    # each within the queue (64 images), together past it: no retry could fit them
    too_many = both_inputs(triton, np.repeat(x, 40, axis=0), np.repeat(pixels, 40, axis=0))
    for inputs, code, words in ((both_empty, "INVALID_ARGUMENT", "no images"),
                                (twice, "INVALID_ARGUMENT", "'images' sent twice"),
                                (too_many, "RESOURCE_EXHAUSTED", "80 images")):
        status, message = status_of(lambda: client.infer(MODEL, inputs, headers=dict(KEY)))
        assert status == f"StatusCode.{code}" and words in message, (status, message)
    rest_cases = ((both_inputs(triton_http, x[:0], pixels[:0]), 400, "no images"),
                  (both_inputs(triton_http, x, pixels)[:1] * 2, 400, "'images' sent twice"),
                  (both_inputs(triton_http, np.repeat(x, 40, axis=0), np.repeat(pixels, 40, axis=0)), 413,
                   "80 images"))
    with triton_http.InferenceServerClient(served[0].removeprefix("http://")) as rest:
        for inputs, code, words in rest_cases:
            with pytest.raises(InferenceServerException) as e:
                rest.infer(MODEL, inputs, headers=dict(KEY))
            assert e.value.status() == str(code) and words in e.value.message(), e.value
        assert rest.infer(MODEL, both_inputs(triton_http, x, pixels), headers=dict(KEY)).as_numpy("logits").shape == (
            2, 6)  # and it serves on


def test_health_and_metadata_as_the_rest_routes_say(served, client):
    assert client.is_server_live() and client.is_server_ready()  # open, as /v2/health: no key asked
    assert client.get_server_metadata().name == "vitserve"
    assert client.is_model_ready(MODEL, headers=dict(KEY))
    metadata = client.get_model_metadata(MODEL, headers=dict(KEY), as_json=True)
    rest = httpx.get(f"{served[0]}/v2/models/{MODEL}", headers={"X-API-Key": "secret"}).json()
    assert metadata["name"] == rest["name"] and metadata["platform"] == rest["platform"]
    for kind in ("inputs", "outputs"):
        assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in metadata[kind]] == [
            (t["name"], t["datatype"], t["shape"]) for t in rest[kind]]


def test_errors_are_status_codes(client):
    x = images(1)
    cases = {
        "StatusCode.NOT_FOUND": lambda: infer(client, x, "images", model="no-such-model"),
        "StatusCode.INVALID_ARGUMENT": lambda: infer(client, x[:, :48], "images"),
        "StatusCode.UNAUTHENTICATED": lambda: infer(client, x, "images", headers={"x-api-key": "wrong"}),
        "StatusCode.RESOURCE_EXHAUSTED": lambda: infer(client, np.repeat(x, QUEUE_LIMIT + 1, axis=0), "images"),
    }
    for code, call in cases.items():
        status, message = status_of(call)
        assert status == code, (code, message)
    status, message = status_of(lambda: infer(client, np.full((1, 3, 96, 96), np.nan, np.float32), "pixel_values"))
    assert status == "StatusCode.INVALID_ARGUMENT" and "not finite" in message
    status, message = status_of(lambda: infer(client, x, "images", outputs=["nothing"]))
    assert status == "StatusCode.INVALID_ARGUMENT" and "no output 'nothing'" in message
    assert infer(client, x, "images").as_numpy("logits").shape == (1, 6)  # and it serves on


def request(x: np.ndarray, model: str = MODEL) -> pb.ModelInferRequest:
    return pb.ModelInferRequest(model_name=model, inputs=[pb.ModelInferRequest.InferInputTensor(
        name="images", datatype="UINT8", shape=x.shape)], raw_input_contents=[x.tobytes()])


def model_infer(channel: grpc.aio.Channel):
    return channel.unary_unary(f"/{SERVICE}/ModelInfer", pb.ModelInferRequest.SerializeToString,
                               pb.ModelInferResponse.FromString)


def test_timeout_and_priority_parameters_past_their_range_or_of_another_type_are_invalid_arguments(served):
    """Whatever type of InferParameter carries them (a bool_param too, which Python's isinstance takes for an int)."""
    x = images(1)
    given = [("timeout", "bool_param", True), ("timeout", "int64_param", 0), ("timeout", "int64_param", -5),
             ("timeout", "string_param", "100"), ("priority", "bool_param", True), ("priority", "int64_param", 101),
             ("priority", "int64_param", 2**63 - 1), ("priority", "string_param", "1")]

    async def calls() -> list:
        async with grpc.aio.insecure_channel(served[1]) as channel:
            answers = []
            for name, kind, value in [*given, ("timeout", "int64_param", 2**63 - 1)]:  # the last within range
                call = request(x)
                setattr(call.parameters[name], kind, value)
                try:
                    answers.append(await model_infer(channel)(call, metadata=tuple(KEY.items())))
                except grpc.aio.AioRpcError as e:
                    answers.append(e)
            return answers

    *refused, within = asyncio.run(calls())
    for (name, kind, _), answer in zip(given, refused):
        assert isinstance(answer, grpc.aio.AioRpcError), (name, kind)
        assert answer.code() == grpc.StatusCode.INVALID_ARGUMENT and name in answer.details(), (name, kind, answer)
    assert isinstance(within, pb.ModelInferResponse)


async def flood(target: str, calls: int, x: np.ndarray) -> list:
    """`calls` ModelInfer calls at once on one channel; each one's response or its error."""
    async with grpc.aio.insecure_channel(target) as channel:
        pending = [model_infer(channel)(request(x), metadata=tuple(KEY.items())) for _ in range(calls)]
        return await asyncio.gather(*pending, return_exceptions=True)


def test_overload_is_unavailable_with_a_retry_hint_and_every_answer_is_right(served):
    x = np.repeat(images(1), 8, axis=0)
    want = run_graph(ROOT / "model_repository" / MODEL / "model.onnx", x[:1])[0]
    answers = asyncio.run(flood(served[1], 40, x))  # 320 images for a queue of 64
    refused = [a for a in answers if isinstance(a, grpc.aio.AioRpcError)]
    assert refused and all(a.code() == grpc.StatusCode.UNAVAILABLE for a in refused), refused[:1]
    assert ("retry-after", "1") in tuple(refused[0].trailing_metadata())
    served_ok = [a for a in answers if isinstance(a, pb.ModelInferResponse)]
    assert served_ok and len(served_ok) + len(refused) == 40
    for answer in served_ok:
        logits = np.frombuffer(answer.raw_output_contents[0], "<f4").reshape(8, 6)
        np.testing.assert_allclose(logits, np.repeat(want, 8, axis=0), atol=1e-5)


async def cancelled_once(target: str, model: str, x: np.ndarray, calls: int, ready) -> list:
    """`calls` ModelInfer calls of `x` at once on one channel, all cancelled once `ready()` (polled off the event
    loop) says so; each one's response, or its error (CancelledError for a call cancelled before its answer)."""
    async with grpc.aio.insecure_channel(target) as channel:
        pending = [model_infer(channel)(request(x, model)) for _ in range(calls)]
        waits = [asyncio.ensure_future(call) for call in pending]
        await asyncio.get_running_loop().run_in_executor(None, ready)
        for call in pending:
            call.cancel()
        return await asyncio.gather(*waits, return_exceptions=True)


@pytest.mark.parametrize("backend,workers", [("thread", 0), ("process", 2)])
def test_cancelled_calls_leave_the_queue_and_only_the_answered_and_the_running_batch_are_computed(backend, workers,
                                                                                                   tmp_path):
    """Eight calls of eight images, a batch each (max_batch_size 8) that takes seconds (fault_graphs.stalling: the
    images' top-left pixel is bright), all cancelled once a call's images wait in the model's queue (the inference
    process's, under the process backend). Computed are the images of the calls answered (none, unless the client was
    held up for a whole batch) and of the batch that was running when the cancellations came: the others left the queue,
    as a call sent afterwards, which runs after anything still queued, shows. (Under the process backend a worker's
    requests that share a frame are answered together, when its last image is computed: so the cancellations come on the
    queue's state, not on a first answer.)"""
    model, batch_s = "slow-deit", 3.0
    source = ROOT / "model_repository" / MODEL
    stalling(source, tmp_path / "repository" / model, turns_for(batch_s, source, tmp_path))
    port = free_port()
    settings = {"backend": backend, "grpc_port": port, "model_repository": tmp_path / "repository",
                "max_batch_size": 8, "queue_limit": QUEUE_LIMIT, "intra_op_threads": 1, "spin_wait": "false",
                "inference_unready_after_s": 600, "inference_kill_after_s": 1200,
                **({"workers": workers} if workers else {})}
    bright = np.repeat(model_pixels(ROOT / "model_repository" / MODEL, photo_bytes("astronaut", "JPEG"))[None], 8, 0)
    dark = model_pixels(ROOT / "model_repository" / MODEL, photo_bytes("coffee", "JPEG"))[None]
    assert bright[0, 0, 0, 0] >= 128 > dark[0, 0, 0, 0]
    with running_service(**settings) as url:
        def figures() -> tuple[float, float]:  # images computed (as each batch ends), and queued
            text = httpx.get(f"{url}/metrics").text
            return (metric(text, "vitserve_images_total", model=model),
                    metric(text, "vitserve_queue_depth", model=model))

        def a_call_waits() -> None:  # a call's images are queued (not in a worker's hands, nor yet in a batch)
            deadline = time.monotonic() + 120
            while figures()[1] < 8:
                assert time.monotonic() < deadline, "no call's images queued within 120 s"
                time.sleep(0.02)

        before, _ = figures()
        answers = asyncio.run(cancelled_once(f"127.0.0.1:{port}", model, bright, 8, a_call_waits))
        answered = [a for a in answers if isinstance(a, pb.ModelInferResponse)]
        cancelled = [a for a in answers if isinstance(a, asyncio.CancelledError)]
        assert cancelled and len(answered) + len(cancelled) == 8, answers  # a call queued then was cancelled
        want = run_graph(ROOT / "model_repository" / MODEL / "model.onnx", bright)[0]  # stalling adds 0 x a count
        for answer in answered:
            np.testing.assert_allclose(np.frombuffer(answer.raw_output_contents[0], "<f4").reshape(8, 6), want,
                                       atol=1e-5)
        with triton.InferenceServerClient(f"127.0.0.1:{port}") as client:
            np.testing.assert_allclose(infer(client, dark, "images", model=model, headers=None).as_numpy("logits"),
                                       run_graph(ROOT / "model_repository" / MODEL / "model.onnx", dark)[0], atol=1e-5)
        computed, queued = figures()
        # the answered calls' images, and at most one batch more: the one running when the cancellations came (or
        # none, had they come as the first call's images were queued and not yet in a batch); the last call's
        assert 8 * len(answered) <= computed - before - 1 <= 8 * (len(answered) + 1), (computed - before,
                                                                                        len(answered))
        assert queued == 0


def test_grpc_and_rest_clients_share_batches(served):
    """A large PNG uploaded to /classify while one-image gRPC calls follow each other: a partial batch waits (up to
    the queue delay) for images still decoding, so the photo runs in a batch with the gRPC calls' tensors, as the
    batch size /classify reports says."""
    x = images(1)
    png = io.BytesIO()
    Image.fromarray(photos.astronaut()).resize((1200, 1200)).save(png, format="PNG", compress_level=1)

    async def together() -> tuple[httpx.Response, list]:
        async with (httpx.AsyncClient(timeout=30, headers={"X-API-Key": "secret"}) as rest,
                    grpc.aio.insecure_channel(served[1]) as channel):
            infer, metadata = model_infer(channel), tuple(KEY.items())
            upload = lambda: rest.post(f"{served[0]}/classify", params={"model": MODEL},  # noqa: E731
                                       files={"file": ("big.png", png.getvalue())})
            await asyncio.gather(upload(), infer(request(x), metadata=metadata))  # connections made
            uploaded, calls = asyncio.create_task(upload()), []

            async def calling():
                while not uploaded.done():
                    calls.append(await infer(request(x), metadata=metadata))

            await asyncio.gather(*(calling() for _ in range(2)))
            return await uploaded, calls

    shared = []
    for _ in range(3):
        response, calls = asyncio.run(together())
        assert response.status_code == 200 and all(isinstance(c, pb.ModelInferResponse) for c in calls)
        shared.append((response.json()["results"][0]["batch_size"], len(calls)))
    # its only image ran beside others at least once: the gRPC calls' (no other client sends)
    assert any(size > 1 for size, _ in shared), shared


def test_a_stream_answers_every_request_and_a_bad_one_with_its_error(client):
    """Triton's bidirectional stream (tritonclient.grpc's start_stream): each request answered by id, in the order
    they finish; a bad one's error comes as its answer and the stream goes on."""
    x, answers = images(2), queue.Queue()
    want = run_graph(ROOT / "model_repository" / MODEL / "model.onnx", x)[0]
    client.start_stream(callback=lambda result, error: answers.put((result, error)), headers=dict(KEY))
    try:
        for i in range(6):
            tensor = triton.InferInput("images", list(x.shape), "UINT8")
            tensor.set_data_from_numpy(x)
            client.async_stream_infer(MODEL, [tensor], request_id=str(i))
        bad = triton.InferInput("images", [1, 48, 96, 3], "UINT8")
        bad.set_data_from_numpy(np.zeros((1, 48, 96, 3), np.uint8))
        client.async_stream_infer(MODEL, [bad], request_id="bad")
        got = [answers.get(timeout=30) for _ in range(7)]
    finally:
        client.stop_stream()
    logits = {result.get_response().id: result.as_numpy("logits") for result, error in got if error is None}
    assert sorted(logits) == [str(i) for i in range(6)]
    for value in logits.values():
        np.testing.assert_allclose(value, want, atol=1e-5)
    (error,) = [error for _, error in got if error is not None]
    assert "input shape [1, 48, 96, 3]" in error.message()
