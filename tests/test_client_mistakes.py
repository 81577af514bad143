"""A careless or unfriendly client's mistakes, on both backends: each gets a 4xx JSON answer the client can read
(never a 5xx, a reset connection or a body that is not JSON), and the server serves right after."""
import contextlib
import gzip
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterable

import httpx
import numpy as np
import pytest
import tritonclient.http as triton_http
from service_process import photo_bytes, process_metrics, running_service
from tritonclient.utils import InferenceServerException

KEY = {"X-API-Key": "secret"}
LIMIT = 2_000_000
JSON_LIMIT = 1_500_000
INFER = "/v2/models/shapes-vit/infer"
JPEG = photo_bytes("chelsea", "JPEG")


@pytest.fixture(scope="module", params=["thread", "process"])
def url(request):
    with running_service(backend=request.param, workers=2, max_upload_bytes=LIMIT, max_json_bytes=JSON_LIMIT,
                         api_key="secret") as base:
        yield base


def urllib_post(url: str, body: bytes | Iterable[bytes], headers: dict[str, str]) -> tuple[int, bytes]:
    """As Python's urllib sends it: the whole body (with `Connection: close`) before reading a byte of the answer;
    an iterable body goes chunked."""
    request = urllib.request.Request(url, data=body, headers={**KEY, **headers}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def raw_exchange(url: str, head: str, body: bytes = b"") -> bytes:
    """Send the request head and all of `body` on a socket before reading, then read the answer to its end."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head.encode() + b"\r\n" + body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def answer_to_head(url: str, head: str) -> tuple[int, bytes]:
    """Send a request's head alone (its body never follows) and read the answer as soon as it is whole: the server
    answered before a byte of the body came (its lingering close is not waited for)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head.encode() + b"\r\n")
        response = http.client.HTTPResponse(s)
        response.begin()
        return response.status, response.read()


def strict_json(text: bytes | str):
    """JSON as every other language parses it: a bare NaN or Infinity is an error."""
    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def fp32_body(value: str) -> bytes:
    data = ",".join([value] + ["0"] * (3 * 96 * 96 - 1))
    return ('{"inputs": [{"name": "pixel_values", "shape": [1, 3, 96, 96], "datatype": "FP32", "data": [%s]}]}'
            % data).encode()


def serves(url: str) -> None:
    r = httpx.post(f"{url}/classify", files={"file": ("a.jpg", JPEG)}, headers=KEY, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("nested", [b"[" * 5000 + b"]" * 5000, b'{"a": ' * 5000 + b"1" + b"}" * 5000])
def test_json_nested_thousands_deep_is_a_400(url, nested):
    r = httpx.post(url + INFER, content=b'{"inputs": ' + nested + b"}", headers=KEY, timeout=30)
    assert r.status_code == 400 and "recursion limit" in r.json()["error"], r.text
    serves(url)


@pytest.mark.parametrize("length", ["abc", "-5", "+2", "99999"])
def test_a_header_length_that_is_no_length_within_the_body_is_a_400(url, length):
    headers = {**KEY, "Inference-Header-Content-Length": length}
    r = httpx.post(url + INFER, content=b'{"inputs": []}', headers=headers, timeout=30)
    assert r.status_code == 400 and "Inference-Header-Content-Length" in r.json()["error"], r.text
    serves(url)


def test_non_finite_fp32_input_is_a_400_and_every_answer_is_strict_json(url):
    for value in ("NaN", "Infinity", "-Infinity", "1e39"):  # 1e39 is past FP32's range: infinity as float32
        r = httpx.post(url + INFER, content=fp32_body(value), headers=KEY, timeout=30)
        assert r.status_code == 400 and "not finite" in strict_json(r.content)["error"], (value, r.text)
    binary = np.zeros((1, 3, 96, 96), "<f4")
    binary[0, 1, 2, 3] = np.nan
    header = json.dumps({"inputs": [{"name": "pixel_values", "shape": [1, 3, 96, 96], "datatype": "FP32",
                                     "parameters": {"binary_data_size": binary.nbytes}}]}).encode()
    r = httpx.post(url + INFER, content=header + binary.tobytes(), timeout=30,
                   headers={**KEY, "Inference-Header-Content-Length": str(len(header))})
    assert r.status_code == 400 and "not finite" in r.json()["error"], r.text
    # finite input the model overflows on: its non-finite outputs are null
    r = httpx.post(url + INFER, content=fp32_body("3e38").replace(b",0", b",3e38"), headers=KEY, timeout=30)
    assert r.status_code == 200, r.text
    logits = next(o for o in strict_json(r.content)["outputs"] if o["name"] == "logits")
    assert logits["shape"] == [1, 6] and None in logits["data"]
    serves(url)


def test_an_over_limit_upload_sent_whole_before_reading_gets_the_413_json(url):
    too_big = np.random.default_rng(0).bytes(10 * LIMIT)
    sized = urllib_post(f"{url}/classify", too_big, {"Content-Type": "image/jpeg"})
    chunked = urllib_post(f"{url}/classify", (too_big[i:i + 2**20] for i in range(0, len(too_big), 2**20)),
                          {"Content-Type": "multipart/form-data; boundary=x"})
    v2 = urllib_post(url + INFER, too_big, {})
    for status, body in (sized, chunked):
        assert status == 413 and strict_json(body)["error"]["code"] == "too_large", body
    assert v2[0] == 413 and "limit" in strict_json(v2[1])["error"]  # the protocol's own error shape
    raw = raw_exchange(url, f"POST /classify HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-API-Key: secret\r\n"
                            f"Content-Type: image/jpeg\r\nContent-Length: {len(too_big)}\r\n", too_big)
    assert raw.startswith(b"HTTP/1.1 413") and b'"too_large"' in raw, raw[:300]
    serves(url)


def test_an_answer_before_the_body_is_read_reaches_a_client_that_sends_it_whole(url):
    body = np.random.default_rng(1).bytes(LIMIT)  # within the limit: refused before a byte of it is read
    status, answer = urllib_post(f"{url}/classify", body, {"X-API-Key": "wrong", "Content-Type": "image/jpeg"})
    assert status == 401 and strict_json(answer)["error"]["code"] == "unauthorized"
    status, answer = urllib_post(f"{url}/v2/models/no-such-model/infer", body, {})
    assert status == 404 and "no-such-model" in strict_json(answer)["error"]
    serves(url)


def test_a_client_that_expects_100_continue_is_refused_before_it_sends_anything(url):
    # as curl asks for a large upload: the 413 comes at once, with no "100 Continue" that would invite the body
    answer = raw_exchange(url, f"POST /classify HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-API-Key: secret\r\n"
                               f"Content-Type: image/jpeg\r\nContent-Length: {10 * LIMIT}\r\n"
                               f"Expect: 100-continue\r\n")
    assert answer.startswith(b"HTTP/1.1 413") and b'"too_large"' in answer, answer[:300]
    serves(url)


def triton_inputs(n: int, binary: bool, scale: float = 1.0) -> list[triton_http.InferInput]:
    """`images` and `pixel_values`, n random images each (all zeros with `scale` 0), as tritonclient.http's
    inputs."""
    rng = np.random.default_rng(n)
    values = ((rng.integers(0, 256, (n, 96, 96, 3)) * scale).astype(np.uint8),
              (rng.standard_normal((n, 3, 96, 96)) * scale).astype(np.float32))
    tensors = [triton_http.InferInput("images", [n, 96, 96, 3], "UINT8"),
               triton_http.InferInput("pixel_values", [n, 3, 96, 96], "FP32")]
    for tensor, value in zip(tensors, values):
        tensor.set_data_from_numpy(value, binary_data=binary)
    return tensors


def test_a_gzip_or_deflate_body_is_read_as_triton_reads_it_and_its_decompressed_size_is_bounded(url):
    with triton_http.InferenceServerClient(url.removeprefix("http://")) as client:
        for binary in (True, False):
            want = client.infer("shapes-vit", triton_inputs(2, binary), headers=dict(KEY)).as_numpy("logits")
            for algorithm in ("gzip", "deflate"):
                got = client.infer("shapes-vit", triton_inputs(2, binary), headers=dict(KEY),
                                   request_compression_algorithm=algorithm).as_numpy("logits")
                np.testing.assert_array_equal(got, want)
        # a few kB compressed, over the limit once decompressed (5.5 MB of binary zeros): 413, as if sent plain
        with pytest.raises(InferenceServerException) as e:
            client.infer("shapes-vit", triton_inputs(40, True, scale=0), headers=dict(KEY),
                         request_compression_algorithm="gzip")
        assert e.value.status() == "413" and "decompressed" in e.value.message()
    bomb = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)  # 256 MiB of zeros in 250 KB of gzip
    body = b"".join(bomb.compress(bytes(2**20)) for _ in range(256)) + bomb.flush()
    assert len(body) < LIMIT
    r = httpx.post(f"{url}/classify", content=body, timeout=30,
                   headers={**KEY, "Content-Encoding": "gzip", "Content-Type": "multipart/form-data; boundary=x"})
    assert r.status_code == 413 and "decompressed" in r.json()["error"]["message"], r.text  # memory: test_service_units
    for coding, status, words in (("br", 415, "Content-Encoding 'br'"), ("gzip", 400, "corrupt")):
        r = httpx.post(url + INFER, content=fp32_body("0"), headers={**KEY, "Content-Encoding": coding}, timeout=30)
        assert r.status_code == status and words in r.json()["error"], r.text
    r = httpx.post(url + INFER, content=gzip.compress(fp32_body("0"))[:-100], timeout=30,
                   headers={**KEY, "Content-Encoding": "gzip"})
    assert r.status_code == 400 and "cut short" in r.json()["error"], r.text
    serves(url)


def test_a_multipart_boundary_past_what_the_parser_takes_is_a_400(url):
    boundary = "b" * 300  # RFC 2046 allows 70; python-multipart refuses past 256 as its parser is made
    body = f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jpg\"\r\n\r\n".encode()
    r = httpx.post(f"{url}/classify", content=body + JPEG + f"\r\n--{boundary}--\r\n".encode(), timeout=30,
                   headers={**KEY, "Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", r.text
    assert "malformed" in r.json()["error"]["message"]
    serves(url)


def test_a_request_head_past_16_kib_is_a_431_and_a_flood_of_one_stalls_no_one(url):
    host, port = url.removeprefix("http://").split(":")
    answer = raw_exchange(url, "GET /models HTTP/1.1\r\nHost: x\r\nX-Big: " + "a" * 20000)  # never ends its head
    assert answer.startswith(b"HTTP/1.1 431 ") and strict_json(answer.partition(b"\r\n\r\n")[2])["error"][
        "code"] == "headers_too_large", answer[:300]
    assert httpx.get(f"{url}/models", headers={**KEY, "X-Fine": "a" * 12000}, timeout=30).status_code == 200
    sent: list[int] = []
    flooding = threading.Event()

    def cpu() -> float:  # the service's CPU seconds, all its processes
        return process_metrics(httpx.get(f"{url}/metrics", timeout=30).text)["process_cpu_seconds_total"]

    before = cpu()

    def flood() -> None:  # 64 MB headers, one connection after another, as fast as loopback takes them
        while flooding.is_set():
            mib = 0
            with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=30) as s:
                s.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\nX-Big: ")
                for mib in range(64):
                    s.sendall(b"a" * 2**20)
            sent.append(mib)

    flooding.set()
    flooder = threading.Thread(target=flood)
    flooder.start()
    waits = []
    try:
        for _ in range(10):  # each on a new connection: spread over the process backend's workers, as the floods are
            start = time.monotonic()
            assert httpx.get(f"{url}/health/live", timeout=30).status_code == 200
            waits.append(time.monotonic() - start)
    finally:
        flooding.clear()
        flooder.join()
    spent = cpu() - before
    assert sent and max(sent) < 63, sent  # each flood's connection was closed long before its header ended
    # A server that read each flood whole spent seconds of its event loop on one (httptools gathered a 64 MB header
    # for 7.7 s) and kept a request waiting 0.2 to 4 s meanwhile; one that cuts the floods off spends about 1 ms of
    # CPU on each (146 floods in 10 requests' time here, on either backend). What a loop spends on a flood is how
    # long it keeps its other clients waiting: told here by CPU time, which a loaded host's scheduling does not
    # stretch as it stretches the waits themselves
    assert spent / len(sent) < 0.05, (spent, len(sent), waits)
    serves(url)


def test_v2_json_past_its_own_limit_is_a_413_that_says_to_send_binary_and_binary_tensors_are_not_bound_by_it(url):
    too_much = json.dumps({"inputs": [{"name": "images", "shape": [1, 96, 96, 3], "datatype": "UINT8",
                                       "data": [128] * (JSON_LIMIT // 4)}]}).encode()
    assert JSON_LIMIT < len(too_much) < LIMIT
    sized = answer_to_head(url, f"POST {INFER} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-API-Key: secret\r\n"
                                f"Content-Length: {len(too_much)}\r\n")  # told before a byte of it is sent
    chunked = urllib_post(url + INFER, (too_much[i:i + 2**16] for i in range(0, len(too_much), 2**16)), {})
    header = answer_to_head(url, f"POST {INFER} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-API-Key: "
                                 f"secret\r\nInference-Header-Content-Length: {JSON_LIMIT + 1}\r\n"
                                 f"Content-Length: {JSON_LIMIT + 1}\r\n")
    for status, answer in (sized, chunked, header):
        assert status == 413 and "VITSERVE_MAX_JSON_BYTES" in strict_json(answer)["error"], answer[:300]
    with triton_http.InferenceServerClient(url.removeprefix("http://")) as client:  # 60 images, 1.66 MB in binary
        images = triton_http.InferInput("images", [60, 96, 96, 3], "UINT8")
        images.set_data_from_numpy(np.zeros((60, 96, 96, 3), np.uint8))
        assert client.infer("shapes-vit", [images], headers=dict(KEY)).as_numpy("logits").shape == (60, 6)
    serves(url)
