"""A careless or unfriendly client's mistakes, on both backends: each gets a 4xx JSON answer the client can read
(never a 5xx, a reset connection or a body that is not JSON), and the server serves right after."""
import contextlib
import functools
import gzip
import http.client
import io
import json
import re
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import test_avif_header as isobmff
import tritonclient.http as triton_http
from face_scenes import astronaut_five_times
from PIL import Image
from service_process import children, metric, photo_bytes, process_metrics, service_and_process
from tritonclient.utils import InferenceServerException

KEY = {"X-API-Key": "secret"}
LIMIT = 2_000_000
JSON_LIMIT = 1_500_000
FACES = 4  # faces per /expression request (VITSERVE_FACE_REQUEST_MAX)
INFER = "/v2/models/shapes-vit/infer"
JPEG = photo_bytes("chelsea", "JPEG")
REFERENCE = Path(__file__).parent / "reference"


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request):
    """(URL, the `python -m service` process) of a server with one decode thread per process, so that a request's
    photos are decoded one after the other, in order."""
    with service_and_process(backend=request.param, workers=2, max_upload_bytes=LIMIT, max_json_bytes=JSON_LIMIT,
                             api_key="secret", face_request_max=FACES, decode_threads=1) as served:
        yield served


@pytest.fixture(scope="module")
def url(server):
    return server[0]


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


def declaring(data: bytes, width: int, height: int) -> bytes:
    """The HEIF/AVIF with its (first) ispe box declaring width x height: a container's size, which may lie."""
    at = data.index(b"ispe") + 8  # past the box's type, version and flags
    return data[:at] + struct.pack(">II", width, height) + data[at + 8:]


# real files (tests/reference/make_bomb_references.py): a photo, and flat photos of 144 and 16 MP in 2 and 4 KB
CHELSEA_HEIC = (REFERENCE / "chelsea_iphone.heic").read_bytes()
AVIF_144MP, HEIC_16MP = (REFERENCE / "flat_12000.avif").read_bytes(), (REFERENCE / "flat_4000.heic").read_bytes()
BOMBS = {"HEIC declaring 60000 x 60000": declaring(CHELSEA_HEIC, 60000, 60000),
         "4000 x 4000 HEIC declaring 64 x 64": declaring(HEIC_16MP, 64, 64),
         "12000 x 12000 AVIF": AVIF_144MP,
         "12000 x 12000 AVIF declaring 64 x 64": declaring(AVIF_144MP, 64, 64),
         "12000 x 12000 AVIF declaring 7000 x 7000": declaring(AVIF_144MP, 7000, 7000),
         # issue 73: 1,000 other items, each read to the end of the file (1.5 GB) before the bomb was found
         "12000 x 12000 AVIF declaring 512 x 512 among 1,000 items over 1.5 MB":
             isobmff.avif([isobmff.bomb().item(1), *(isobmff.Item(id, extents=((0, 0),)) for id in range(2, 1002))],
                          padding=1_500_000)}


def post(url: str, route: str, files: list[tuple[str, bytes]], field: str = "file", **params) -> httpx.Response:
    return httpx.post(url + route, files=[(field, (name, data)) for name, data in files], params=params,
                      headers=KEY, timeout=60)


def test_heic_and_avif_bombs_are_413s_on_every_route_and_alone_among_several_files(url):
    """Past the server's 50 MP by what is decoded, not by what the container declares: libheif refuses a HEIC larger
    than its header says, and an AVIF's AV1 sequence headers are read before dav1d allocates their frames."""
    routes = [("/classify", {}), ("/classify", {"attention": "true"}), ("/attention-map", {}),
              ("/expression", {}), ("/expression", {"detect": "false"})]
    for name, bomb in BOMBS.items():
        for route, params in routes:
            r = post(url, route, [(name, bomb)], **params)
            assert r.status_code == 413 and r.json()["error"]["code"] == "image_too_large", (name, route, r.text)
        r = post(url, "/classify", [("chelsea.jpg", JPEG), (name, bomb)], field="files")
        assert r.status_code == 200, (name, r.text)
        ok, refused = r.json()["results"]
        assert ok["predictions"] and refused["error"]["code"] == "image_too_large", (name, r.text)
    for name, cut in (("cut.heic", CHELSEA_HEIC[:len(CHELSEA_HEIC) // 2]), ("cut.avif", AVIF_144MP[:900])):
        r = post(url, "/classify", [(name, cut)])
        assert r.status_code in (400, 415) and r.json()["error"]["code"] in ("bad_image", "unsupported_media_type")
    serves(url)


def peaks(pids: list[int]) -> dict[int, tuple[int, int]]:
    """Each process's (peak, current) resident memory in bytes (/proc/PID/status VmHWM, VmRSS)."""
    found = {}
    for pid in pids:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        found[pid] = tuple(int(fields[key].split()[0]) * 1024 for key in ("VmHWM", "VmRSS"))
    return found


def test_an_avif_that_lies_about_its_size_is_refused_before_its_frame_is_allocated(server):
    """Four at once, each 144 MP (216 MB of frame for dav1d) declaring 64 x 64: no process of the service grows."""
    url, proc = server
    serves(url)
    pids = [proc.pid, *children(proc.pid)]
    for pid in pids:  # each process's peak from now on (Linux: 5 resets VmHWM to the current RSS)
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    before = peaks(pids)
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: post(url, "/classify", [("lie.avif", BOMBS["12000 x 12000 AVIF declaring "
                                                                                        "64 x 64"])]), range(4)))
    after = peaks(pids)
    assert all(r.status_code == 413 for r in answers), [r.text for r in answers]
    grown = {pid: ((after[pid][0] - before[pid][1]) >> 20, (after[pid][1] - before[pid][1]) >> 20) for pid in pids}
    assert all(peak < 64 and now < 32 for peak, now in grown.values()), grown  # MB
    serves(url)


@functools.cache
def slow_avif() -> bytes:
    """A flat 6000 x 6000 AVIF: 1 KB that takes dav1d a tenth of a second or more to decode."""
    buf = io.BytesIO()
    Image.new("RGB", (6000, 6000), (90, 120, 150)).save(buf, "AVIF", quality=10, speed=10)
    return buf.getvalue()


def test_a_deadline_passes_between_the_files_of_a_slow_decode_and_on_a_photo_without_faces(url):
    """40 files, each a tenth of a second or more of decoding, and a deadline of 1 s: the 504 comes between two of
    them, and the rest are never decoded; a face-less photo's deadline is checked on its own way (before its decode,
    before or after its face detection), with no batch to wait for (the message says where each request stopped)."""
    r = post(url, "/classify", [(f"{i}.avif", slow_avif()) for i in range(40)], field="files", timeout_ms=1000)
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
    stopped = re.search(r"deadline passed after (\d+) of its 40 images' decode", r.json()["error"]["message"])
    assert stopped and 0 < int(stopped[1]) < 40, r.text  # between files: after the first, before the last
    r = post(url, "/expression", [("chelsea.jpg", JPEG)], timeout_ms=1)
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded", r.text
    # at one of the photo's own checks (which, the host's speed decides), with no batch to wait for
    assert re.search(r"deadline passed (before its decode|before its face detection|after its face detection) on",
                     r.json()["error"]["message"]), r.text
    serves(url)


def test_a_request_with_more_faces_than_it_may_have_classified_is_a_413_and_its_other_photos_go_undetected(url):
    """FACES (4) per request: one photo of five faces is past it; of three such photos, decoded one after the other
    (one decode thread), the first is detected and the two after it are not decoded at all."""
    scene, _ = astronaut_five_times()
    buf = io.BytesIO()
    scene.save(buf, "JPEG", quality=90)
    five = buf.getvalue()
    r = post(url, "/expression", [("five.jpg", five)])
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_faces", r.text
    decoded = metric(httpx.get(f"{url}/metrics", timeout=10).text, "vitserve_decode_seconds_count")
    r = post(url, "/expression", [(f"{i}.jpg", five) for i in range(3)], field="files")
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_faces", r.text
    assert metric(httpx.get(f"{url}/metrics", timeout=10).text, "vitserve_decode_seconds_count") == decoded + 1
    r = post(url, "/expression", [(f"{i}.jpg", JPEG) for i in range(FACES + 1)], field="files", detect="false")
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_many_faces", r.text  # known before any decode
    assert metric(httpx.get(f"{url}/metrics", timeout=10).text, "vitserve_decode_seconds_count") == decoded + 1
    r = post(url, "/expression", [(f"{i}.jpg", JPEG) for i in range(FACES)], field="files", detect="false")
    assert r.status_code == 200 and len(r.json()["results"]) == FACES, r.text
    serves(url)


@pytest.mark.parametrize("parameter, value", [
    ("timeout", 10**309), ("timeout", 2**64), ("timeout", 0), ("timeout", -1), ("timeout", 1.5), ("timeout", 1e308),
    ("timeout", True), ("timeout", "100"), ("timeout", [1]), ("priority", 101), ("priority", -1), ("priority", 2**70),
    ("priority", False), ("priority", "1"), ("priority", 1.0)])
def test_v2_timeout_and_priority_past_their_range_or_of_another_json_type_are_400s_naming_them(url, parameter, value):
    body = json.dumps({"inputs": [{"name": "images", "shape": [1, 96, 96, 3], "datatype": "UINT8",
                                   "data": [128] * (96 * 96 * 3)}], "parameters": {parameter: value}})
    r = httpx.post(url + INFER, content=body, headers=KEY, timeout=30)
    assert r.status_code == 400 and f"parameters.{parameter}" in r.json()["error"], r.text
    within = json.loads(body)
    within["parameters"] = {"timeout": 2**64 - 1, "priority": 0}
    assert httpx.post(url + INFER, json=within, headers=KEY, timeout=30).status_code == 200
