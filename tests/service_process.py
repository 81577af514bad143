"""Start the real service (`python -m service`) on a free loopback port, for end-to-end tests."""
import gzip
import io
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import IO

import httpx
import numpy as np
import onnxruntime as ort
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from skimage import data as photos

from repository import InputPolicy, graph_inputs
from service.images.decode import upload_input

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # (bench/ is no package: bench scripts import this file too)
from census import children  # noqa: E402  the process tree, as the GPU check's census reads it


def free_port() -> int:
    """A loopback port that no socket holds now, chosen below the kernel's ephemeral range: there the kernel never
    hands it to a client connection or a bind to port 0 (of this process or any other) before the service binds
    it, so only another explicit bind can take it meanwhile (service_and_process then starts again on another)."""
    low = _ephemeral_low()
    if low > _PORTS_FROM + 1000:
        for _ in range(200):
            port = random.SystemRandom().randrange(_PORTS_FROM, low)  # not `random`'s: tests may seed that one
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # an odd host's range: any port free now
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PORTS_FROM = 20000  # above Ray's worker ports (10002-19999 by default)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


# how the service says that a port it was given is taken (the process backend's supervisor, uvicorn, gRPC)
PORT_TAKEN = re.compile(r"address already in use|failed to bind to address", re.IGNORECASE)
START_TRIES = 4


@contextmanager
def running_service(wait_ready: bool = True, **settings) -> Iterator[str]:
    """Yield the base URL of a service started with VITSERVE_<NAME> settings; stop it afterwards. Its gRPC server
    takes a free port too, unless `grpc_port` says which."""
    with service_and_process(wait_ready, **settings) as (url, _):
        yield url


@contextmanager
def service_and_process(wait_ready: bool = True, root: Path = ROOT, **settings
                        ) -> Iterator[tuple[str, subprocess.Popen]]:
    """running_service's URL, and the `python -m service` process (the supervisor, under the process backend), run
    from `root` (another checkout's, for a benchmark's baseline).

    A port free when chosen may be taken before the service binds it (by another test's server, say): a service
    that exits saying so is started again on other ports, up to START_TRIES times. The URL is given only once
    this process holds the port's listening socket, so that it is never another server's that answered."""
    path = "/health/ready" if wait_ready else "/health/live"
    for attempt in range(1, START_TRIES + 1):
        port = free_port()
        chosen = {"grpc_port": free_port(), **settings}
        # a file, not a pipe: a server that logs a lot never blocks on it
        output = tempfile.TemporaryFile()  # noqa: SIM115 (closed below, or after the service stops)
        proc = subprocess.Popen([sys.executable, "-m", "service", "--port", str(port), "--log-level", "warning"],
                                cwd=root, env=service_env(chosen), stdout=output, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            started = _serving(url, path, proc, output, port)
        except BaseException:
            stop(proc, 10)
            output.close()
            raise
        if started:
            break
        output.seek(0)
        said = output.read().decode(errors="replace")
        output.close()
        if attempt == START_TRIES:
            raise RuntimeError(f"the service found its port taken {START_TRIES} times; the last said:\n{said}")
    try:
        yield url, proc
    except BaseException:  # a failed test shows what the service logged (pytest prints a failure's stderr)
        stop(proc, 10)
        output.seek(0)
        print(f"the service said:\n{output.read().decode(errors='replace')[-8000:]}", file=sys.stderr)
        raise
    finally:
        stop(proc, 10)
        output.close()


def _serving(url: str, path: str, proc: subprocess.Popen, output: IO[bytes], port: int,
             timeout: float = 120) -> bool:
    """Until `path` answers 200 from a server of this process (True); False where the process exited because a
    port it was given was taken, RuntimeError with its output where it exited otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            output.seek(0)
            said = output.read().decode(errors="replace")
            if PORT_TAKEN.search(said):
                return False
            raise RuntimeError(f"the service exited with {proc.returncode}:\n{said}")
        if listens(proc.pid, port):
            try:
                if httpx.get(url + path, timeout=2).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}{path} did not answer 200 within {timeout}s")


def role_pids(supervisor: int, role: str) -> list[int]:
    """The supervisor's children of one role (supervisor.ROLES), by their process name."""
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    return [int(pid) for pid in children if process_name(int(pid)) == role]


def process_name(pid: int) -> str | None:
    """Its name (/proc/PID/comm), or None where it has gone meanwhile (a killed child, reaped)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the process's sockets (none if it has gone)."""
    try:
        links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
    except OSError:
        return set()
    return {link[len("socket:["):-1] for link in links if link.startswith("socket:[")}


def listens(pid: int, port: int) -> bool:
    """Whether the process, or one it started, holds a socket listening on the loopback port (True where /proc
    cannot tell)."""
    if not Path("/proc/net/tcp").exists():
        return True
    held = set().union(*(socket_inodes(p) for p in (pid, *children(pid))))
    return bool(held & sockets_on(port, "0A"))


def rows_on(port: int, state: str) -> list[list[str]]:
    """The rows of /proc/net/tcp of this port's TCP sockets in a state ("0A" listening, "01" established)."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return [row for row in rows if int(row[1].rsplit(":", 1)[1], 16) == port and row[3] == state]


def sockets_on(port: int, state: str) -> set[str]:
    """The inodes of this port's TCP sockets in a state."""
    return {row[9] for row in rows_on(port, state)}


def server_ends(port: int) -> dict[int, str]:
    """The inode of the server's end of each connection to the port ("0" until accepted), by the client's port."""
    return {int(row[2].rsplit(":", 1)[1], 16): row[9] for row in rows_on(port, "01")}


def workers_on(port: int) -> dict[int, set[str]]:
    """Each HTTP worker (of the process backend) listening on the port, with the inodes of all its sockets."""
    listening, workers = sockets_on(port, "0A"), {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or process_name(int(proc.name)) != "vitserve-http":
            continue
        inodes = socket_inodes(int(proc.name))
        if inodes & listening:
            workers[int(proc.name)] = inodes
    return workers


def every_worker_on(port: int, count: int, timeout: float = 120) -> dict[int, set[str]]:
    """workers_on, once `count` workers are there: a worker is named vitserve-http only once its interpreter has
    started, and ready may answer from one while another still imports."""
    deadline = time.monotonic() + timeout
    while len(workers := workers_on(port)) < count:
        assert time.monotonic() < deadline, f"{len(workers)} of {count} HTTP workers listening"
        time.sleep(0.05)
    return workers


def holders(port: int, clients: list[socket.socket], timeout: float = 120) -> list[int]:
    """The HTTP worker that accepted each client's connection, once every one is accepted."""
    deadline = time.monotonic() + timeout
    while True:
        ends, held = server_ends(port), {inode: pid for pid, inodes in workers_on(port).items() for inode in inodes}
        found = [held.get(ends.get(client.getsockname()[1], "0")) for client in clients]
        if None not in found:
            return found
        assert time.monotonic() < deadline, f"{found.count(None)} of {len(clients)} connections never accepted"
        time.sleep(0.05)


def connections_to_every_worker(url: str, workers: int, each: int, most: int = 1000) -> dict[int, list[socket.socket]]:
    """`each` open connections to every one of the `workers` HTTP workers of the process backend's service at `url`,
    by the worker's pid.
    Where the kernel sends a new connection is its own affair (SO_REUSEPORT hashes it onto one worker's socket):
    connections are opened until every worker holds `each`, those more than that closed, and at most `most`
    opened. The caller closes the ones it gets."""
    port = int(url.rsplit(":", 1)[1])
    kept: dict[int, list[socket.socket]] = {pid: [] for pid in every_worker_on(port, workers)}
    opened = 0
    try:
        while any(len(held) < each for held in kept.values()):
            assert opened < most, f"{most} connections reached the workers {[len(h) for h in kept.values()]} times"
            batch = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(8)]
            opened += len(batch)
            for client, pid in zip(batch, holders(port, batch)):
                if len(kept.setdefault(pid, [])) < each:
                    kept[pid].append(client)
                else:
                    client.close()
    except BaseException:
        for client in (c for held in kept.values() for c in held):
            client.close()
        raise
    return kept


@contextmanager
def running_ray_service(replicas: int, log: Path, cpus_per_replica: float = 1.0, session_affinity: bool = False,
                        **settings) -> Iterator[tuple[str, str]]:
    """`python -m service.ray_serve` on a local Ray: yield (base URL, its "N replicas running" line); stop it
    (it deletes its application and the Ray instance it started) afterwards. Its output goes to `log`."""
    port = free_port()
    command = [sys.executable, "-m", "service.ray_serve", "--replicas", str(replicas),
               "--cpus-per-replica", str(cpus_per_replica), "--port", str(port)]
    command += ["--session-affinity"] if session_affinity else []
    with log.open("w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=service_env(settings), stdout=out, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", wait_for_line(log, "replicas running", proc)
    finally:
        stop(proc, 60)


def service_env(settings: dict) -> dict[str, str]:
    """This environment plus VITSERVE_<NAME> for each setting (and no Ray usage reporting)."""
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
            **{f"VITSERVE_{k.upper()}": str(v) for k, v in settings.items()}}


def stop(proc: subprocess.Popen, grace_s: float) -> None:
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def wait_for_line(log: Path, text: str, proc: subprocess.Popen, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in log.read_text().splitlines() if text in line]
        if found:
            return found[0]
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}:\n{log.read_text()}")
        time.sleep(0.5)
    raise TimeoutError(f"no {text!r} within {timeout}s:\n{log.read_text()}")


def wait_for(url: str, path: str, proc: subprocess.Popen, timeout: float = 120,
             output: IO[bytes] | None = None) -> None:
    """Until `path` answers 200; the process's output (its stdout pipe, or the file it writes to) if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if output is not None:
                output.seek(0)
            said = (output or proc.stdout).read().decode()
            raise RuntimeError(f"the service exited with {proc.returncode}:\n{said}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url}{path} did not answer 200 within {timeout}s")


def write_model(folder: Path, source: Path, name: str, **changes) -> None:
    """`source`'s graph into `folder` under the model name `name`, the manifest last (as an exporter publishes)."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {**json.loads((source / "manifest.json").read_text()), "name": name, **changes}
    for file in manifest["files"].values():
        shutil.copyfile(source / file["path"], folder / f".{file['path']}.part")
        (folder / f".{file['path']}.part").rename(folder / file["path"])
    (folder / "manifest.json").write_text(json.dumps(manifest))


def photo_bytes(name: str, fmt: str, **options) -> bytes:
    """A real photograph from scikit-image, encoded as JPEG or PNG (`options`: Pillow's, e.g. quality=90)."""
    buf = io.BytesIO()
    Image.fromarray(getattr(photos, name)()).save(buf, format=fmt, **options)
    return buf.getvalue()


def awkward_jpegs() -> dict[str, bytes]:
    """JPEGs of the kinds a decoder trips on, from real photos: baseline, progressive, grayscale, CMYK, EXIF-rotated
    (stored turned; the viewer turns it back) and truncated (cut in its entropy-coded data)."""
    chelsea, coffee = Image.fromarray(photos.chelsea()), Image.fromarray(photos.coffee())

    def jpeg(image: Image.Image, **options) -> bytes:
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=90, **options)
        return buf.getvalue()

    exif = Image.Exif()
    exif[0x0112] = 6  # turn 90 degrees clockwise to view
    baseline = jpeg(coffee)
    return {"baseline": baseline, "progressive": jpeg(chelsea, progressive=True),
            "grayscale": jpeg(Image.fromarray(photos.camera())), "CMYK": jpeg(coffee.convert("CMYK")),
            "EXIF-rotated": jpeg(chelsea.transpose(Image.Transpose.ROTATE_90), exif=exif),
            "truncated": baseline[:len(baseline) // 2]}


def model_pixels(model_dir: Path, image: bytes) -> np.ndarray:
    """The model's uint8 [H, W, 3] input for an image, through the service's decoding and preprocessing."""
    policy = InputPolicy.from_manifest(json.loads((model_dir / "manifest.json").read_text())["input"])
    return upload_input(image, policy, 10**8)


def run_graph(path: Path, x: np.ndarray) -> list[np.ndarray]:
    """A plain ORT session on uint8 [N, H, W, 3] images or float [N, 3, H, W] normalised pixels."""
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, graph_inputs(x))


def direct_probabilities(model_dir: Path, image: bytes) -> np.ndarray:
    """What the exported model says of an image, through the service's preprocessing and a plain ORT session."""
    logits = run_graph(model_dir / "model.onnx", model_pixels(model_dir, image)[None])[0][0].astype(np.float64)
    return np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()


def leave_mid_request(url: str, model: str, image: bytes, images: int, clients: int) -> None:
    """`clients` /classify uploads of `images` copies of `image`, each client gone a third into its upload, then as
    many gone right after sending it all (their requests decoded and queued)."""
    host, port = url.removeprefix("http://").split(":")
    parts = b"".join(b"--b\r\nContent-Disposition: form-data; name=\"files\"; filename=\"a.jpg\"\r\n\r\n" + image
                     + b"\r\n" for _ in range(images)) + b"--b--\r\n"
    head = (f"POST /classify?model={model} HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
            f"boundary=b\r\nContent-Length: {len(parts)}\r\n\r\n").encode()
    for sent in (parts[: len(parts) // 3], parts):
        for _ in range(clients):
            with socket.create_connection((host, int(port))) as s:
                s.sendall(head + sent)


def process_metrics(text: str) -> dict[str, float]:
    """The process_* samples of Prometheus text: CPU seconds, resident memory, open files."""
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("process_")}


def metric(text: str, name: str, **labels) -> float:
    """One sample's value from Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        match = re.match(rf"{name}(?:\{{(.*)\}})? (\S+)$", line)
        if match and ",".join(sorted(match.group(1).split(",")) if match.group(1) else []) == want:
            return float(match.group(2))
    return 0.0


@contextmanager
def otlp_receiver(keep: bool = True) -> Iterator[tuple[str, list]]:
    """(endpoint, spans received so far): POST /v1/traces, as an OpenTelemetry collector takes it (the tracing
    tests). Without `keep`, each export's count of spans in their place (the GPU check's traces under load)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                          ExportTraceServiceResponse)
    spans: list = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            request = ExportTraceServiceRequest.FromString(body)
            scopes = [scope for resource in request.resource_spans for scope in resource.scope_spans]
            if keep:
                spans.extend(span for scope in scopes for span in scope.spans)
            else:
                spans.append(sum(len(scope.spans) for scope in scopes))
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", spans
    finally:
        server.shutdown()
