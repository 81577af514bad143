"""wrk, a C load generator, as the neutral client of the service benchmarks: one fixed request posted back to back
over kept-alive connections, so the client costs the shared cores little and treats every server alike.

`apt-get install wrk`. The request's body lies in a file that a Lua script reads once per wrk thread; the script's
`done` writes the figures as JSON (latency in microseconds, as wrk keeps them). wrk speaks no gRPC: `grpc_run`
gives the same figures for the Open Inference Protocol's ModelInfer from service.loadtest's clients.
"""
import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.loadtest import BOUNDARY, grpc_requests, multipart, run_level_processes, v2_body

SCRIPT = """
local f = assert(io.open(os.getenv("WRK_BODY"), "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
for name, value in string.gmatch(os.getenv("WRK_HEADERS"), "([^\\n:]+): ([^\\n]+)") do
  wrk.headers[name] = value
end

done = function(summary, latency, requests)
  local e = summary.errors
  local out = assert(io.open(os.getenv("WRK_OUT"), "w"))
  out:write(string.format(
    '{"requests": %d, "duration_us": %d, "connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d, ' ..
    '"p50": %f, "p90": %f, "p99": %f, "max": %f}',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max))
  out:close()
end
"""


@dataclass
class Request:
    """A fixed POST: the path, its headers and body, and how many images it carries."""
    path: str
    headers: dict[str, str]
    body: bytes
    images: int = 1


@dataclass
class Figures:
    requests_per_s: float
    images_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    errors: int  # connection errors, timeouts and non-2xx answers
    non_2xx: int | None = None  # of which non-2xx answers (wrk's runs)


def classify_request(jpeg: bytes, files: int = 1, path: str = "/classify", query: str = "") -> Request:
    """`files` copies of the JPEG as a multipart upload (`file` for one, `files` repeated for several)."""
    body = multipart([("photo.jpg", jpeg)] * files, "file" if files == 1 else "files")
    return Request(path + (f"?{query}" if query else ""),
                   {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}, body, files)


def v2_request(model: str, name: str, x: np.ndarray) -> Request:
    """The batch `x` as a KServe v2 binary tensor, binary outputs back (tritonclient's encoding)."""
    body, headers = v2_body(name, x)
    return Request(f"/v2/models/{model}/infer", headers, body, len(x))


def available() -> bool:
    return shutil.which("wrk") is not None


def run(url: str, request: Request, clients: int, seconds: float, threads: int = 1) -> Figures:
    """wrk with `clients` connections for `seconds` (one thread by default: the client's share of the cores
    stays small)."""
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        (folder / "body").write_bytes(request.body)
        (folder / "post.lua").write_text(SCRIPT)
        env = {"WRK_BODY": str(folder / "body"), "WRK_OUT": str(folder / "out.json"),
               "WRK_HEADERS": "\n".join(f"{k}: {v}" for k, v in request.headers.items()), "PATH": "/usr/bin:/bin"}
        done = subprocess.run(["wrk", "-t", str(min(threads, clients)), "-c", str(clients), "-d", f"{seconds:g}s",
                               "--timeout", "30s", "-s", str(folder / "post.lua"), url + request.path],
                              env=env, capture_output=True, text=True)
        if done.returncode or not (folder / "out.json").exists():
            raise RuntimeError(f"wrk failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-500:]}")
        out = json.loads((folder / "out.json").read_text())
    errors = sum(out[k] for k in ("connect", "read", "write", "status", "timeout"))
    per_s = (out["requests"] - out["status"]) / (out["duration_us"] / 1e6)
    return Figures(per_s, per_s * request.images, out["p50"] / 1e3, out["p90"] / 1e3, out["p99"] / 1e3, errors,
                   out["status"])


def grpc_run(target: str, model: str, name: str, x: np.ndarray, clients: int, seconds: float) -> Figures:
    """What `run` measures, for gRPC ModelInfer at `target` (host:port) of the batch `x` as input `name`:
    service.loadtest's clients over two processes, one channel each, no warm-up (every answer in the window counts,
    as wrk's do)."""
    level = run_level_processes(f"grpc://{target}", (grpc_requests, (model, name, x)), clients, seconds, 2,
                                warmup=0.0, files_per_request=len(x))
    latency = level.latency_ms or {p: float("nan") for p in ("p50", "p90", "p99")}
    return Figures(level.requests_per_s, level.images_per_s, latency["p50"], latency["p90"], latency["p99"],
                   sum(level.failures.values()))
