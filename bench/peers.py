"""vitserve beside the servers a user would pick instead: images/s (and p50 latency) on the same graph, the same
preprocessing and the same external client.

    python bench/peers.py                                   # every peer, 1, 8 and 32 clients, 2 rounds of 8 s
    python bench/peers.py --seconds 2 --rounds 1 --peers vitserve fastapi

The peers, each a subprocess on a free loopback port, each but vitserve in a virtual environment of its own under
build/peers/NAME/venv (made with `python -m venv` and pip on first use, reused afterwards; onnxruntime, Pillow and
numpy pinned to this environment's versions, but numpy < 2 for PyTriton, so the graph's kernels and the JPEG
decoder are the same everywhere):

vitserve: `python -m service` from this environment, default backend (thread on a CPU host), access log off.
          JPEG: POST /classify?model=shapes-deit&top_k=1; tensor: POST /v2/models/shapes-deit/infer.
fastapi:  the service a developer writes first (bench/peers/fastapi_server.py): FastAPI + uvicorn[standard], one
          process, a sync endpoint reading the multipart upload and running the graph on that one image.
litserve: LitServe (bench/peers/litserve_server.py), batching up to 16 images for at most 5 ms; JPEG only.
triton:   Triton Inference Server through PyTriton (bench/peers/triton_server.py: its wheel bundles tritonserver,
          Triton's HTTP front end and dynamic batcher, max batch 16, 5 ms queue delay), with Python models over the
          session (their functions run in the script's process; Triton's Python backend stub hands them each batch
          over ZeroMQ and shared memory). Tensor: KServe v2, as to vitserve; JPEG: Triton takes tensors, not
          uploads, so the JPEG's bytes travel as one BYTES element in the binary tensor extension and are decoded in
          the model. Made with Debian's /usr/bin/python3.11: PyTriton's Python 3.11 backend stub fails under a newer
          3.11 (a model load error, "_thread.RLock has no attribute _recursion_count").

The graph is model_repository/shapes-deit/model.onnx, fed uint8 `images` and an empty float `pixel_values`; every
peer preprocesses with vitserve's own functions (service.images.decode.upload_input, imported from this checkout:
bench/peers/common.py). Peer sessions keep ONNX Runtime's defaults (a thread per core, spinning between runs), as
their authors would open them; vitserve runs with its own. All servers stay up for the whole run, one at a time
under load; the others are paused meanwhile (SIGSTOP, SIGCONT for their turn), since not every server is quiet when
idle: each one's idle CPU is printed first (LitServe's batching loop polls its request queue every millisecond).

Requests: one image each, the chelsea photo (451 x 300) as JPEG quality 90 (route "JPEG"), or its preprocessed
uint8 [1, 96, 96, 3] as a KServe v2 binary tensor (route "tensor", only where the server speaks it). The client is
wrk (bench/wrk.py), one thread, the same fixed request back to back over kept-alive connections. Route "gRPC"
sends the tensor to the Open Inference Protocol's gRPC ModelInfer (vitserve's port 8001 and Triton's), from
service.loadtest's Python clients in two processes (wrk speaks no gRPC): a heavier client than wrk, the same for
both servers. Each server
must first answer with vitserve's top-1 class for the photo. Rounds interleave everything (round r: every peer x
route x clients, in order); figures are medians over rounds. A peer that cannot be installed or started is named
with its error and the rest goes on. The client runs on the same machine as the servers.
"""
import argparse
import json
import os
import signal
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
import wrk  # noqa: E402
from service_process import free_port, photo_bytes  # noqa: E402

from repository import read_entry  # noqa: E402
from service.images.decode import upload_input  # noqa: E402

MODEL = "shapes-deit"
SERVERS = ROOT / "bench" / "peers"
BUILD = ROOT / "build" / "peers"
ROUTES = ("JPEG", "tensor", "gRPC")
# the same onnxruntime and image libraries as vitserve runs with (service/images/decode.py's, which every peer imports:
# bench/peers/common.py): the graph's kernels and the JPEG decoder are not what differs
SHARED = [f"{name}=={version(name)}" for name in ("onnxruntime", "pillow", "opencv-python-headless", "simplejpeg",
                                                  "pi-heif")] + ["jsonschema"]


@dataclass(frozen=True)
class Peer:
    name: str
    packages: list[str]  # its virtual environment's requirements; none: this environment (vitserve)
    base_python: str  # what its virtual environment is made with
    command: Callable[[Path, list[int]], list[str]]  # (its python, its ports) -> the server's command line
    ports: int  # how many free ports it needs; the first is HTTP, the second (where it speaks gRPC) gRPC
    jpeg: Callable[[bytes], wrk.Request]
    tensor: Callable[[np.ndarray], wrk.Request] | None  # None: it takes no tensors
    top1: Callable[[httpx.Response], int]  # the class index in its answer to `jpeg`
    grpc: bool = False  # the tensor through the Open Inference Protocol's gRPC ModelInfer too


def vitserve_jpeg(jpeg: bytes) -> wrk.Request:
    return wrk.classify_request(jpeg, query=f"model={MODEL}&top_k=1")


def upload(jpeg: bytes) -> wrk.Request:
    return wrk.classify_request(jpeg)


def triton_jpeg(jpeg: bytes) -> wrk.Request:
    """The JPEG as a KServe v2 BYTES tensor [1, 1] in the binary tensor extension (an element is its length as a
    little-endian uint32, then its bytes), for the model shapes-deit-jpeg; outputs as JSON."""
    blob = struct.pack("<I", len(jpeg)) + jpeg
    header = json.dumps({"inputs": [{"name": "jpeg", "datatype": "BYTES", "shape": [1, 1],
                                     "parameters": {"binary_data_size": len(blob)}}]}).encode()
    return wrk.Request(f"/v2/models/{MODEL}-jpeg/infer", {"Inference-Header-Content-Length": str(len(header)),
                                                         "Content-Type": "application/octet-stream"}, header + blob)


def v2_tensor(x: np.ndarray) -> wrk.Request:
    return wrk.v2_request(MODEL, "images", x)


def v2_outputs(r: httpx.Response) -> dict[str, np.ndarray]:
    """A KServe v2 answer's outputs, JSON or the binary extension (JSON header, then each output's raw bytes)."""
    size = int(r.headers.get("Inference-Header-Content-Length", len(r.content)))
    header, blob, outputs = json.loads(r.content[:size]), r.content[size:], {}
    types = {"FP32": np.float32, "INT64": np.int64, "UINT8": np.uint8, "BYTES": object}
    for out in header["outputs"]:
        n = out.get("parameters", {}).get("binary_data_size")
        if n is None:
            data = np.array(out["data"], types[out["datatype"]])
        else:
            data, blob = np.frombuffer(blob[:n], types[out["datatype"]]), blob[n:]
        outputs[out["name"]] = data.reshape(out["shape"])
    return outputs


PEERS = {
    "vitserve": Peer("vitserve", [], sys.executable,
                     lambda python, ports: [str(python), "-m", "service", "--port", str(ports[0]), "--log-level",
                                            "warning"],
                     2, vitserve_jpeg, v2_tensor, lambda r: r.json()["results"][0]["predictions"][0]["index"], True),
    "fastapi": Peer("fastapi", ["fastapi", "uvicorn[standard]", "python-multipart", f"numpy=={version('numpy')}",
                                *SHARED], sys.executable,
                    lambda python, ports: [str(python), str(SERVERS / "fastapi_server.py"), str(ports[0])],
                    1, upload, None, lambda r: r.json()["index"]),
    "litserve": Peer("litserve", ["litserve", "python-multipart", f"numpy=={version('numpy')}", *SHARED],
                     sys.executable,
                     lambda python, ports: [str(python), str(SERVERS / "litserve_server.py"), str(ports[0])],
                     1, upload, None, lambda r: r.json()["index"]),
    "triton": Peer("triton", ["nvidia-pytriton", "numpy<2", *SHARED], "/usr/bin/python3.11",
                   lambda python, ports: [str(python), str(SERVERS / "triton_server.py"), *map(str, ports)],
                   3, triton_jpeg, v2_tensor, lambda r: int(v2_outputs(r)["index"].ravel()[0]), True),
}
VERSIONS = ["fastapi", "uvicorn", "litserve", "nvidia-pytriton", "tritonclient", "onnxruntime", "numpy", "pillow"]


def run_quietly(command: list[str], what: str) -> None:
    """Run a set-up step; on failure raise with the last lines it printed (pip's are many)."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{tail}")


def environment(peer: Peer) -> Path:
    """The python of the peer's virtual environment, made and installed on first use (and again when its
    requirements change)."""
    if not peer.packages:
        return Path(sys.executable)
    folder = BUILD / peer.name
    python, stamp = folder / "venv" / "bin" / "python", folder / "requirements.txt"
    wanted = "\n".join(peer.packages) + "\n"
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    if not Path(peer.base_python).exists():
        raise RuntimeError(f"{peer.base_python} not found: {peer.name} needs it for its virtual environment")
    print(f"{peer.name}: making {folder / 'venv'} with {peer.base_python} and installing {' '.join(peer.packages)}",
          flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    run_quietly([peer.base_python, "-m", "venv", "--clear", str(folder / "venv")],
                f"{peer.base_python} -m venv (on Debian: apt-get install python3.11-venv)")
    run_quietly([str(python), "-m", "pip", "install", "--quiet", *peer.packages], "pip install")
    stamp.write_text(wanted)
    return python


def installed(python: Path) -> str:
    """The versions that matter here, as that environment has them."""
    code = ("from importlib.metadata import version\nfor n in %r:\n    try: print(n, version(n))\n"
            "    except Exception: pass" % VERSIONS)
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True).stdout
    return ", ".join(out.split("\n")[:-1])


@dataclass
class Running:
    peer: Peer
    proc: subprocess.Popen
    url: str
    log: Path
    grpc: str | None  # its gRPC host:port


def start(peer: Peer) -> Running:
    """The peer's server, in a process group of its own (LitServe and Triton start children), its output in
    build/peers/NAME/server.log."""
    python = environment(peer)
    print(f"{peer.name}: {python}: {installed(python)}", flush=True)
    ports = [free_port() for _ in range(peer.ports)]
    log = BUILD / peer.name / "server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    grpc = f"127.0.0.1:{ports[1]}" if peer.grpc else None
    env = {**os.environ, "VITSERVE_ACCESS_LOG": "false", "PYTHONUNBUFFERED": "1",
           **({"VITSERVE_GRPC_PORT": str(ports[1])} if peer.grpc else {})}
    with log.open("w") as out:
        proc = subprocess.Popen(peer.command(python, ports), cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return Running(peer, proc, f"http://127.0.0.1:{ports[0]}", log, grpc)


def log_tail(running: Running, lines: int = 12) -> str:
    return "\n".join(running.log.read_text(errors="replace").strip().splitlines()[-lines:])


def ask(running: Running, request: wrk.Request) -> httpx.Response:
    return httpx.post(running.url + request.path, content=request.body, headers=request.headers, timeout=30)


def wait_answering(running: Running, request: wrk.Request, timeout: float = 300) -> int:
    """Until the server answers the JPEG request with 200; its top-1 class index then."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running.proc.poll() is not None:
            raise RuntimeError(f"exited with {running.proc.returncode}:\n{log_tail(running)}")
        try:
            r = ask(running, request)
            if r.status_code == 200:
                return running.peer.top1(r)
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no 200 within {timeout:g}s:\n{log_tail(running)}")


def signal_group(running: Running, sig: signal.Signals) -> None:
    try:
        os.killpg(running.proc.pid, sig)
    except ProcessLookupError:  # it is gone already
        pass


def only_awake(running: dict[str, Running], name: str) -> None:
    """Every server but `name` paused (SIGSTOP to its process group), `name` resumed: the one under load has the
    cores to itself, whatever the others do when idle (LitServe's batching loop polls its request queue every
    millisecond). Every peer here answers at once after two minutes paused."""
    for other, r in running.items():
        signal_group(r, signal.SIGCONT if other == name else signal.SIGSTOP)
    time.sleep(0.5)  # its timers and threads catch up before the load starts


def group_cpu_s(running: Running) -> float:
    """CPU seconds of every live process in the server's process group (/proc/PID/stat: utime, stime)."""
    total = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == running.proc.pid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def idle_cpu(running: dict[str, Running], seconds: float = 5) -> dict[str, float]:
    """Each server's CPU use while nobody sends it anything, in % of one core."""
    before = {name: group_cpu_s(r) for name, r in running.items()}
    time.sleep(seconds)
    return {name: (group_cpu_s(r) - before[name]) / seconds * 100 for name, r in running.items()}


def stop(running: Running, grace_s: float = 30) -> None:
    """SIGTERM to the server (vitserve and Triton drain and exit; PyTriton stops its tritonserver), then SIGKILL
    to whatever of its process group is left."""
    signal_group(running, signal.SIGCONT)  # a paused process would not act on SIGTERM
    running.proc.terminate()
    try:
        running.proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    signal_group(running, signal.SIGKILL)
    running.proc.wait()


def requests_for(peer: Peer, jpeg: bytes, pixels: np.ndarray) -> dict[str, wrk.Request | np.ndarray | None]:
    """Each route's request: wrk's, or for gRPC the tensor itself."""
    return {"JPEG": peer.jpeg(jpeg), "tensor": peer.tensor(pixels[None]) if peer.tensor else None,
            "gRPC": pixels[None] if peer.grpc else None}


def grpc_logits(target: str, x: np.ndarray) -> np.ndarray:
    """ModelInfer at `target` with `x` as `images`: its logits (tritonclient.grpc, the protocol's own client)."""
    import tritonclient.grpc as triton
    with triton.InferenceServerClient(target) as client:
        tensor = triton.InferInput("images", list(x.shape), "UINT8")
        tensor.set_data_from_numpy(x)
        return client.infer(MODEL, [tensor], outputs=[triton.InferRequestedOutput("logits")]).as_numpy("logits")


def check(running: Running, requests: dict[str, wrk.Request | np.ndarray | None], expected: int) -> None:
    """Every route the peer serves answers 200 with vitserve's top-1 class (the tensor routes' from their logits)."""
    got = {"JPEG": wait_answering(running, requests["JPEG"])}
    if requests["tensor"] is not None:
        r = ask(running, requests["tensor"])
        r.raise_for_status()
        got["tensor"] = int(v2_outputs(r)["logits"][0].argmax())
    if requests["gRPC"] is not None:
        got["gRPC"] = int(grpc_logits(running.grpc, requests["gRPC"])[0].argmax())
    wrong = {route: index for route, index in got.items() if index != expected}
    if wrong:
        raise RuntimeError(f"top-1 {wrong}, vitserve says {expected}")


def cell(figures: list[wrk.Figures], clients: int) -> str:
    per_s = statistics.median(f.images_per_s for f in figures)
    if clients == 1:
        return f"{per_s:.0f} ({statistics.median(f.p50_ms for f in figures):.1f} ms)"
    return f"{per_s:.0f}"


def table(results: dict[tuple[str, str, int], list[wrk.Figures]], names: list[str], clients: list[int]) -> str:
    columns = [(route, c) for route in ROUTES for c in clients]
    heads = [f"{route}, {c} client{'s' if c > 1 else ''}" for route, c in columns]
    rows = [[name] + [cell(results[name, route, c], c) if (name, route, c) in results else "–"
                      for route, c in columns] for name in names]
    widths = [max(len(r[i]) for r in rows + [["server"] + heads]) for i in range(len(heads) + 1)]
    lines = [" | ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(r, widths)))
             for r in [["server"] + heads] + rows]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])


def start_all(names: list[str], jpeg: bytes, pixels: np.ndarray, running: dict[str, Running],
              failed: dict[str, str]) -> tuple[dict[str, dict[str, wrk.Request | None]], int]:
    """Every peer started at once into `running` (LitServe's and Triton's start-ups take a while), then checked
    against vitserve's answer; those that fail go into `failed` with why. (their requests, vitserve's top-1)"""
    for name in names:
        try:
            running[name] = start(PEERS[name])
        except Exception as e:
            failed[name] = f"{type(e).__name__}: {e}"
    if "vitserve" not in running:
        raise RuntimeError(f"vitserve, the reference answer, did not start: {failed.get('vitserve')}")
    requests = {name: requests_for(PEERS[name], jpeg, pixels) for name in running}
    expected = wait_answering(running["vitserve"], requests["vitserve"]["JPEG"])
    for name in list(running):
        try:
            check(running[name], requests[name], expected)
        except Exception as e:
            failed[name] = f"{type(e).__name__}: {e}"
            stop(running.pop(name))
    return requests, expected


def load(running: Running, route: str, request: wrk.Request | np.ndarray, clients: int, seconds: int) -> wrk.Figures:
    """wrk's figures, or for gRPC the same from service.loadtest's clients (wrk.grpc_run)."""
    if route == "gRPC":
        return wrk.grpc_run(running.grpc, MODEL, "images", request, clients, seconds)
    return wrk.run(running.url, request, clients, seconds)


def measure(running: dict[str, Running], loads: list[tuple[str, str, wrk.Request | np.ndarray, int]], rounds: int,
            seconds: int, failed: dict[str, str]) -> dict[tuple[str, str, int], list[wrk.Figures]]:
    """The figures of each (peer, route, clients), round by round; a peer that exits under load goes into `failed`
    and the rest goes on without it."""
    results: dict[tuple[str, str, int], list[wrk.Figures]] = {}
    for r in range(rounds):
        awake = None
        for name, route, request, c in loads:
            if name in failed:
                continue
            if name != awake:
                only_awake(running, awake := name)
            try:
                figures = load(running[name], route, request, c, seconds)
            except RuntimeError as e:  # the server refused or dropped the connection: say so, and go on
                print(f"round {r + 1}: {name} {route} {c} clients: {e}", flush=True)
                continue
            results.setdefault((name, route, c), []).append(figures)
            if figures.errors:
                print(f"round {r + 1}: {name} {route} {c} clients: {figures.errors} wrk errors (non-2xx, "
                      f"connection errors, timeouts)", flush=True)
            if running[name].proc.poll() is not None:
                failed[name] = f"exited under load ({running[name].proc.returncode}):\n{log_tail(running[name])}"
                print(f"{name}: {failed[name]}", flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", nargs="+", default=list(PEERS), choices=list(PEERS),
                   help="which to measure (vitserve always starts: its answer is the reference)")
    p.add_argument("--clients", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--seconds", type=int, default=8, help="per measurement (wrk takes whole seconds)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1, help="seconds of load per peer and route before round 1")
    args = p.parse_args()
    if not wrk.available():
        sys.exit("wrk is not installed (apt-get install wrk)")

    jpeg = photo_bytes("chelsea", "JPEG", quality=90)
    entry = read_entry(ROOT / "model_repository" / MODEL)
    pixels = upload_input(jpeg, entry.policy, 50_000_000)
    running: dict[str, Running] = {}
    failed: dict[str, str] = {}
    try:  # whatever happens, every server started is stopped
        requests, expected = start_all(["vitserve"] + [n for n in args.peers if n != "vitserve"], jpeg, pixels,
                                       running, failed)
        for name, why in failed.items():
            print(f"{name}: left out: {why}", flush=True)
        print(f"started: {', '.join(f'{n} {r.url}' for n, r in running.items())}; every one answers the photo's "
              f"top-1 class as vitserve does: {entry.manifest['labels'][expected]}", flush=True)
        measured = [n for n in running if n in args.peers]
        loads = [(n, route, requests[n][route], c) for n in measured for route in ROUTES for c in args.clients
                 if requests[n][route] is not None]
        print("idle CPU, % of one core (all its processes): " + ", ".join(
            f"{name} {share:.1f}" for name, share in idle_cpu(running).items()), flush=True)
        if args.warmup > 0:  # each peer's route once under load, untimed: its first batches of each size
            for name, route, request, _ in loads[::len(args.clients)]:
                only_awake(running, name)
                load(running[name], route, request, max(args.clients), args.warmup)
        results = measure(running, loads, args.rounds, args.seconds, failed)
    finally:
        for r in running.values():
            stop(r)

    print(f"\nimages/s, median of {args.rounds} round(s) of {args.seconds}s (1 client: and p50 latency); "
          f"{os.cpu_count()} CPU cores, wrk on the same machine; –: the server takes no such request")
    print(table(results, measured, args.clients))
    for name, why in failed.items():  # the reason's first line and, from a log, its last
        lines = why.strip().splitlines()
        print(f"{name}: failed: {lines[0]}" + (f" ... {lines[-1]}" if len(lines) > 1 else ""))


if __name__ == "__main__":
    main()
