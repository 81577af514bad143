"""A careless or unfriendly client's mistakes, on both backends: each gets a 4xx JSON answer the client can read
(never a 5xx, a reset connection or a body that is not JSON), and the server serves right after."""
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterable

import httpx
import numpy as np
import pytest
from service_process import photo_bytes, running_service

KEY = {"X-API-Key": "secret"}
LIMIT = 2_000_000
INFER = "/v2/models/shapes-vit/infer"
JPEG = photo_bytes("chelsea", "JPEG")


@pytest.fixture(scope="module", params=["thread", "process"])
def url(request):
    with running_service(backend=request.param, workers=2, max_upload_bytes=LIMIT, api_key="secret") as base:
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
