"""The HTTP path's CPU per request beside the floor: a bare ASGI app under the same server (uvicorn, httptools, uvloop)
that reads the body and answers a fixed JSON (bench/peers/bare_asgi.py). The figure issue 56 moves.

    python bench/http_floor.py                              # 32 connections, 3 rounds of 6 s
    python bench/http_floor.py --clients 1 32 --rounds 5 --backends process
    git worktree add /tmp/base COMMIT && python bench/http_floor.py --baseline /tmp/base   # before and after

Servers, all started side by side on the `null` repository (bench/service_overhead.py: a graph that reads one value
of each image, so every CPU second is the service's own), one process serving HTTP each:
  bare     the floor;
  thread   `python -m service --backend thread`: HTTP, decode, batching and the session in one process;
  process  `python -m service --backend process --workers 1`: one HTTP worker, and the inference process beside it;
  with --baseline DIR, both backends again as another checkout (DIR) serves them ("thread@base", "process@base").
Routes, each one fixed request posted back to back by wrk (bench/wrk.py) over kept-alive connections:
  classify  POST /classify, the 451 x 300 chelsea JPEG (quality 90) as a multipart upload;
  x8        the same photo 8 times in one upload;
  v2        POST /v2/models/null/infer, the model's uint8 [1, 96, 96, 3] input as a binary tensor (no decode).
The bare app gets the same bytes. Rounds interleave servers and routes; figures are medians over rounds.
CPU comes from /proc/PID/stat before and after each run: "HTTP ms/req" is the process that serves HTTP (for the thread
backend, all of the service), "beyond decode" subtracts what decoding and resizing the request's JPEGs costs one
thread here, "x bare" divides that by the bare app's CPU per request on the same bytes; "inference ms/req" is the
process backend's inference process.
"""
import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
import wrk  # noqa: E402
from process_cost import cpu_by_role, cpu_seconds  # noqa: E402
from service_overhead import decode_cpu_ms, null_repo  # noqa: E402
from service_process import free_port, model_pixels, photo_bytes, service_and_process  # noqa: E402

from repository import read_entry  # noqa: E402
from service.supervisor import ROLES  # noqa: E402

INFERENCE, WORKERS = ROLES


@contextmanager
def bare_server() -> Iterator[tuple[str, int]]:
    """(URL, pid) of the bare ASGI app under uvicorn with httptools and uvloop."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--app-dir", str(ROOT / "bench" / "peers"),
                             "bare_asgi:app", "--port", str(port), "--loop", "uvloop", "--http", "httptools",
                             "--no-access-log", "--lifespan", "off", "--log-level", "warning"])
    try:
        for _ in range(300):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait()


def cpu_reader(backend: str, pid: int) -> Callable[[], tuple[float, float]]:
    """A function giving (HTTP process CPU s, inference process CPU s) now."""
    if backend == "process":
        def read() -> tuple[float, float]:
            roles = cpu_by_role(pid)
            return roles[WORKERS], roles[INFERENCE]
        return read
    return lambda: (cpu_seconds(pid)[1], 0.0)


def measure(url: str, read: Callable[[], tuple[float, float]], request: wrk.Request, clients: int,
            seconds: float) -> dict[str, float]:
    before = read()
    figures = wrk.run(url, request, clients, seconds)
    after = read()
    done = figures.requests_per_s * seconds
    return {"requests_per_s": figures.requests_per_s, "p50": figures.p50_ms, "errors": figures.errors,
            "http": (after[0] - before[0]) / done * 1e3, "inference": (after[1] - before[1]) / done * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", default=["thread", "process"], choices=["thread", "process"])
    p.add_argument("--routes", nargs="+", default=["classify", "x8", "v2"], choices=["classify", "x8", "v2"])
    p.add_argument("--clients", nargs="+", type=int, default=[32], help="wrk connections")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", type=Path, help="another checkout of vitserve, served beside this one")
    p.add_argument("--cache", type=Path, default=ROOT / "build" / "bench")
    args = p.parse_args()
    if not wrk.available():
        raise SystemExit("wrk is not installed: apt-get install wrk")
    repo = null_repo(args.cache)
    jpeg = photo_bytes("chelsea", "JPEG", quality=90)
    pixels = model_pixels(repo / "null", jpeg)
    decode_ms = decode_cpu_ms(jpeg, read_entry(repo / "null").policy)
    requests = {"classify": wrk.classify_request(jpeg, 1, query="model=null&top_k=1"),
                "x8": wrk.classify_request(jpeg, 8, query="model=null&top_k=1"),
                "v2": wrk.v2_request("null", "images", pixels[None])}
    runs: dict[tuple[str, str, int], list[dict]] = {}
    with ExitStack() as stack:
        url, pid = stack.enter_context(bare_server())
        servers = {"bare": (url, cpu_reader("bare", pid))}
        checkouts = {"": ROOT, **({"@base": args.baseline.resolve()} if args.baseline else {})}
        for backend in args.backends:
            for suffix, root in checkouts.items():
                url, proc = stack.enter_context(service_and_process(
                    root=root, model_repository=repo, backend=backend, workers=1, access_log=False,
                    max_batch_size=16, queue_limit=1024, max_files=64))
                servers[backend + suffix] = (url, cpu_reader(backend, proc.pid))
        for url, _ in servers.values():  # warm-up: connections, pages of the arenas
            for route in args.routes:
                wrk.run(url, requests[route], max(args.clients), 1)
        for _ in range(args.rounds):
            for route in args.routes:
                for clients in args.clients:
                    for name, (url, read) in servers.items():
                        runs.setdefault((name, route, clients), []).append(
                            measure(url, read, requests[route], clients, args.seconds))
    medians = {key: {k: statistics.median(r[k] for r in rounds) for k in rounds[0]} for key, rounds in runs.items()}
    print(f"HTTP path CPU per request against a bare ASGI app (uvicorn, httptools, uvloop), one HTTP process each, wrk "
          f"on the same {os.cpu_count()} cores; medians of {args.rounds} rounds of {args.seconds:g}s. Decoding and "
          f"resizing the JPEG costs one thread {decode_ms:.3f} ms here")
    print(f"{'server':<12} {'route':<8} {'clients':>7} {'req/s':>7} {'p50 ms':>6} {'errors':>6} | {'HTTP ms/req':>11} "
          f"{'beyond decode':>13} {'x bare':>6} | {'inference ms/req':>16}")
    for (name, route, clients), m in medians.items():
        decoded = decode_ms * requests[route].images if route != "v2" and name != "bare" else 0.0
        beyond, floor = m["http"] - decoded, medians["bare", route, clients]["http"]
        print(f"{name:<12} {route:<8} {clients:>7} {m['requests_per_s']:>7,.0f} {m['p50']:>6.2f} {m['errors']:>6.0f} | "
              f"{m['http']:>11.3f} {beyond:>13.3f} {beyond / floor:>6.1f} | "
              + (f"{m['inference']:>16.3f}" if name.startswith("process") else f"{'':>16}"))


if __name__ == "__main__":
    main()
