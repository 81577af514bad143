"""CPU per request and per image of each role of the process backend, the ceiling each role sets, and what a host of
N cores would reach.

    python bench/process_cost.py                            # both parts, the service's max batch size (16)
    python bench/process_cost.py --max-batch-size 64 --cores 16 64 --rounds 3

Everything runs on the `null` repository (bench/service_overhead.py: a graph that reads one value of each image,
so every CPU second is the service's own).

Part "ceiling": the inference process alone, saturated. It is started as the supervisor starts it and driven by
two `ProcessBackend`s in this process (the HTTP workers' side without HTTP: records filled once, `--in-flight`
requests of 1 or 8 images kept in flight). It is one process, so its CPU per image there caps a host of any
size, however fast its GPU and however many its cores: 1000 / (ms per image) images/s. Where the driver, one
process, used a whole core, the figure is a floor on that ceiling.

Part "http": `python -m service --backend process` with `--workers` HTTP workers, and wrk (bench/wrk.py) on the
same machine posting one fixed request: `/v2` with a uint8 tensor, or `/classify` with the 451 x 300 chelsea JPEG;
1 or 8 images per request. Route `grpc` sends the `/v2` tensor to the gRPC ModelInfer instead, from
service.loadtest's clients (wrk speaks no gRPC): two client processes, one channel each. Each process's CPU time
comes from /proc/PID/stat before and after the wrk run, its role from its name (supervisor.ROLES; the supervisor is
the parent). Rounds interleave the routes; figures are medians. The inference process's CPU per image here is what
it spends at this load, with the batches this load forms; the HTTP workers scale with cores, at 1000 / (their ms
per image) images/s each. On N cores the default N - 1 workers reach (N - 1) times that, the inference process its
saturated ceiling (part "ceiling", at the same batch size and images per request), and the service the lower of the
two: that role binds. "GPU decoding" counts only what a worker does when JPEGs are decoded on the GPU: its CPU less
what decoding and resizing the JPEG costs one thread here.
"""
import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
import wrk  # noqa: E402
from service_overhead import decode_cpu_ms, null_repo  # noqa: E402
from service_process import free_port, model_pixels, photo_bytes, running_service  # noqa: E402

from repository import read_entry  # noqa: E402
from service.engine.backends.process import ProcessBackend  # noqa: E402
from service.core.settings import Settings  # noqa: E402
from service.supervisor import ROLES, inference_main  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
INFERENCE, WORKERS = ROLES


def cpu_seconds(pid: int) -> tuple[str, float]:
    """(the process's name, its CPU seconds so far)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    return stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / TICKS


# -- ceiling -----------------------------------------------------------------------------------------------------

async def drive(socket_path: Path, settings: Settings, pid: int, in_flight: int, images: int,
                seconds: float) -> dict[str, float]:
    """Two ProcessBackends keep `in_flight` requests of `images` images on the null model: the images the inference
    process ran in `seconds`, its CPU per image and this process's cores."""
    backends = [ProcessBackend(settings, socket_path) for _ in range(2)]
    await asyncio.gather(*(b.start() for b in backends))
    await asyncio.gather(*(b.loaded() for b in backends))
    done, measuring, stopping = [0], [False], [False]

    async def client(backend: ProcessBackend) -> None:
        while not stopping[0]:
            with backend.records("null", "image", images) as lease:
                await backend.run("null", lease, 1)
            done[0] += images * measuring[0]

    clients = [asyncio.create_task(client(backends[i % 2])) for i in range(in_flight)]
    await asyncio.sleep(1.0)  # warm: arenas touched, queues full
    measuring[0], start, cpu, own = True, time.perf_counter(), cpu_seconds(pid)[1], time.process_time()
    await asyncio.sleep(seconds)
    measuring[0], elapsed = False, time.perf_counter() - start
    figures = {"images_per_s": done[0] / elapsed, "ms": (cpu_seconds(pid)[1] - cpu) / done[0] * 1e3,
               "driver_cores": (time.process_time() - own) / elapsed}
    stopping[0] = True
    await asyncio.gather(*clients)
    for backend in backends:
        await backend.close()
    return figures


def ceiling(repo: Path, batches: list[int], images: list[int], in_flight: int, seconds: float,
            rounds: int) -> dict[tuple[int, int], float]:
    """The saturated inference process's CPU ms per image, by (max batch size, images per request)."""
    print(f"The inference process alone, saturated: 2 ProcessBackends in this process keep {in_flight} requests in "
          f"flight; medians of {rounds} rounds of {seconds:g}s")
    print(f"{'max batch':>9} {'img/req':>7} {'img/s':>8} {'CPU ms/img':>10} {'its ceiling img/s':>17} "
          f"{'driver cores':>12}")
    context, out = multiprocessing.get_context("spawn"), {}
    for batch in batches:
        settings = Settings(model_repository=repo, max_batch_size=batch, queue_limit=8 * in_flight, max_files=64,
                            warmup_runs=1)
        with tempfile.TemporaryDirectory(dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None) as folder:
            socket_path = Path(folder) / "inference.sock"
            inference = context.Process(target=inference_main, args=(settings, socket_path, "warning"))
            inference.start()
            try:
                for n in images:
                    runs = [asyncio.run(drive(socket_path, settings, inference.pid, in_flight, n, seconds))
                            for _ in range(rounds)]
                    m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                    out[batch, n] = m["ms"]
                    print(f"{batch:>9} {n:>7} {m['images_per_s']:>8,.0f} {m['ms']:>10.4f} {1e3 / m['ms']:>17,.0f} "
                          f"{m['driver_cores']:>12.2f}" + ("  (driver-bound)" if m["driver_cores"] > 0.9 else ""),
                          flush=True)
            finally:
                inference.terminate()
                inference.join()
    return out


# -- http --------------------------------------------------------------------------------------------------------

def supervisor_pid(port: int) -> int:
    """The `python -m service --port PORT` process."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"service" in argv and str(port).encode() in argv and b"-m" in argv:
            return int(proc.name)
    raise RuntimeError(f"no service process on port {port}")


def cpu_by_role(supervisor: int) -> dict[str, float]:
    """CPU seconds so far of the supervisor, the inference process and all HTTP workers together."""
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    seconds = {"supervisor": cpu_seconds(supervisor)[1], INFERENCE: 0.0, WORKERS: 0.0}
    for pid in map(int, children):
        name, cpu = cpu_seconds(pid)
        if name in seconds:
            seconds[name] += cpu
    return seconds


def load(url: str, grpc_target: str, request: wrk.Request | np.ndarray, clients: int, seconds: float) -> wrk.Figures:
    """wrk's figures for an HTTP request; for a tensor, gRPC ModelInfer's of it at `grpc_target`."""
    if isinstance(request, np.ndarray):
        return wrk.grpc_run(grpc_target, "null", "images", request, clients, seconds)
    return wrk.run(url, request, clients, seconds)


def measure(url: str, grpc_target: str, supervisor: int, request: wrk.Request | np.ndarray, clients: int,
            seconds: float) -> dict[str, float]:
    """One load's figures and each role's CPU ms per request."""
    before = cpu_by_role(supervisor)
    figures = load(url, grpc_target, request, clients, seconds)
    after = cpu_by_role(supervisor)
    done = figures.requests_per_s * seconds
    out = {"requests_per_s": figures.requests_per_s, "p50": figures.p50_ms, "errors": figures.errors}
    for role in before:
        out[role] = (after[role] - before[role]) / done * 1e3  # ms per request
    return out


def projection(cores: int, worker_ms: float, ceiling_ms: float | None) -> str:
    workers = max(2, cores - 1) * 1e3 / worker_ms
    if ceiling_ms is None:
        return f"{workers:>17,.0f} {'(workers)':>9}"
    cap = 1e3 / ceiling_ms
    return f"{min(cap, workers):>17,.0f} {'inference' if cap < workers else 'workers':>9}"


def http(repo: Path, args: argparse.Namespace, ceilings: dict[tuple[int, int], float]) -> None:
    jpeg = photo_bytes("chelsea", "JPEG", quality=90)
    pixels = model_pixels(repo / "null", jpeg)
    decode_ms = decode_cpu_ms(jpeg, read_entry(repo / "null").policy)
    grpc_port = free_port()
    grpc_target = f"127.0.0.1:{grpc_port}"
    requests = {(route, n): (wrk.v2_request("null", "images", pixels[None].repeat(n, 0)) if route == "v2" else
                             pixels[None].repeat(n, 0) if route == "grpc" else
                             wrk.classify_request(jpeg, n, query="model=null&top_k=1"))
                for route in args.routes for n in args.images}
    batch = args.max_batch_size[0]
    runs: dict[tuple, list[dict]] = {}
    with running_service(model_repository=repo, backend="process", workers=args.workers, access_log=False,
                         max_batch_size=batch, queue_limit=1024, max_files=64, grpc_port=grpc_port) as url:
        supervisor = supervisor_pid(int(url.rsplit(":", 1)[1]))
        for request in requests.values():  # warm-up: connections, pages of the arenas
            load(url, grpc_target, request, max(args.clients), 1)
        for _ in range(args.rounds):
            for (route, n), request in requests.items():
                for clients in args.clients:
                    runs.setdefault((route, n, clients), []).append(
                        measure(url, grpc_target, supervisor, request, clients, args.seconds))
    print(f"\nThrough HTTP: {args.workers} HTTP workers, max batch {batch}, wrk on the same {os.cpu_count()} cores; "
          f"medians of {args.rounds} rounds of {args.seconds:g}s. CPU ms per image (per request in brackets); "
          f"decoding and resizing the JPEG costs one thread {decode_ms:.2f} ms here")
    print(f"{'route':<9} {'img/req':>7} {'clients':>7} {'img/s':>7} {'p50 ms':>6} {'errors':>6} | "
          f"{'HTTP workers':>15} {'inference':>15} {'supervisor':>10} | {'worker img/s/core':>17} | "
          + " ".join(f"{f'{c} cores: img/s':>17} {'binds':>9}" for c in args.cores))
    for (route, n, clients), rounds in runs.items():
        m = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        worker, ceiling_ms = m[WORKERS] / n, ceilings.get((batch, n))
        print(f"{route:<9} {n:>7} {clients:>7} {m['requests_per_s'] * n:>7.0f} {m['p50']:>6.1f} {m['errors']:>6.0f} | "
              f"{worker:>6.3f} ({m[WORKERS]:>6.3f}) {m[INFERENCE] / n:>6.3f} ({m[INFERENCE]:>6.3f}) "
              f"{m['supervisor'] / n:>10.4f} | {1e3 / worker:>17,.0f} | "
              + " ".join(projection(c, worker, ceiling_ms) for c in args.cores))
        if route == "classify":
            gpu_worker = max(worker - decode_ms, 1e-3)
            print(f"{'  with GPU decoding':<45} | {gpu_worker:>6.3f} {'':>8} {'':>15} {'':>10} | "
                  f"{1e3 / gpu_worker:>17,.0f} | "
                  + " ".join(projection(c, gpu_worker, ceiling_ms) for c in args.cores))
    if not ceilings:
        print("(the inference process's ceiling was not measured: the projections count the workers alone)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["ceiling", "http"], choices=["ceiling", "http"])
    p.add_argument("--max-batch-size", nargs="+", type=int, default=[16],
                   help="the service's (the first is the one the http part serves with)")
    p.add_argument("--images", nargs="+", type=int, default=[1, 8], help="images per request")
    p.add_argument("--clients", nargs="+", type=int, default=[8, 32], help="wrk connections, for the http part")
    p.add_argument("--routes", nargs="+", default=["v2", "classify"], choices=["v2", "classify", "grpc"])
    p.add_argument("--workers", type=int, default=2, help="HTTP workers, for the http part")
    p.add_argument("--in-flight", type=int, default=512, help="requests kept in flight, for the ceiling part")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cores", nargs="+", type=int, default=[16], help="host sizes to project to")
    p.add_argument("--cache", type=Path, default=ROOT / "build" / "bench")
    args = p.parse_args()
    if "http" in args.parts and not wrk.available():
        raise SystemExit("wrk is not installed: apt-get install wrk")
    repo = null_repo(args.cache)
    ceilings = {}
    if "ceiling" in args.parts:
        ceilings = ceiling(repo, args.max_batch_size, args.images, args.in_flight, args.seconds, args.rounds)
    if "http" in args.parts:
        http(repo, args, ceilings)


if __name__ == "__main__":
    main()
