"""Load-test a running vitserve: images/s, requests/s and latency percentiles per concurrency level.

    python -m service.loadtest --url http://localhost:8000 --concurrency 1,4,16,64
    python -m service.loadtest --url http://localhost:8000 --concurrency 1,4,16,64 --files-per-request 8 \\
        --processes 4 --plot load.png --json load.json
    python -m service.loadtest --url http://localhost:8000 --model shapes-deit --v2 UINT8 --concurrency 64,256
    python -m service.loadtest --grpc localhost:8001 --model shapes-deit --v2 UINT8 --concurrency 8,32 --processes 2

Each level runs `--concurrency` clients, each sending requests back to back over a kept-alive connection; what
completes in the `--duration` seconds after a short warm-up counts. A request carries `--files-per-request` images
(the multipart field `file` for one, `files` repeated for several), so images/s = requests/s x files. With
`--v2 FP32|UINT8` the requests go to the KServe v2 infer route instead: a random tensor of the model's input shape
(`files-per-request` images in its batch), in the binary tensor extension, outputs asked for in binary.
With `--grpc HOST:PORT` as well, the same tensors go to the Open Inference Protocol's gRPC ModelInfer in
`raw_input_contents`, encoded once; each client process holds one channel (one HTTP/2 connection, as
tritonclient.grpc does), so --processes also spreads the load over the process backend's workers.
`--processes P` splits a level's clients over P spawned client processes, each its own event loop, all measuring
the same wall-clock window; their images, failures and latency samples are merged.

Reported per level: images/s, requests/s, p50/p90/p95/p99 latency per request, failures by status (a 503 from a
full queue counts as one), and the client's own CPU: cores used over the window and ms per image. A row is marked
CLIENT-BOUND when a client process used >= 90% of a core: its event loop, not the server, set the figure, so run
more --processes.

The client is aiohttp sending multipart bodies encoded once per image set: about 0.15 ms of CPU per request with
one ~55 KB JPEG and 0.35 ms with 8, where an aiohttp.FormData per request costs 0.25 and 0.75 ms (and httpx's
pool 2 ms at 8 connections, 6 ms at 32). So 20,000 images/s takes about one client core at 8 files per request,
three at one. A load tester on the server's own cores must not eat the throughput it measures.
"""
import argparse
import asyncio
import io
import json
import mimetypes
import multiprocessing
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import aiohttp
import numpy as np

# sends request number i on the session (an aiohttp session, or a gRPC channel) and returns its status: HTTP's,
# or the name of gRPC's
Send = Callable[[object, int], Awaitable[int | str]]
# a Send's factory and its plain arguments: what a spawned client process rebuilds its Send from
Sender = tuple[Callable[..., Send], tuple]

# share of one core above which a client process's single-threaded event loop, not the server, limits the figure
CLIENT_BOUND_CORES = 0.9
# random once per process, so it cannot occur in an image; fixed from then on, so bodies are encoded once
BOUNDARY = uuid.uuid4().hex
DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.uint8): "UINT8"}  # the protocol's names of tensor dtypes
GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"  # the protocol's method path


@dataclass
class LevelResult:
    concurrency: int
    seconds: float
    requests: int
    requests_per_s: float
    images: int
    images_per_s: float
    latency_ms: dict[str, float]  # per request
    failures: dict[str, int]
    client_cpu_s: float  # all client processes, over the measured window
    client_cores: float
    client_bound: bool


@dataclass
class Share:
    """One client process's part of a level, raw so that parts merge: latencies of its successful requests."""
    latencies_ms: list[float]
    failures: dict[str, int]
    cpu_s: float


def percentiles(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {}
    cuts = statistics.quantiles(samples, n=100, method="inclusive") if len(samples) > 1 else samples * 99
    return {"p50": cuts[49], "p90": cuts[89], "p95": cuts[94], "p99": cuts[98], "mean": statistics.fmean(samples)}


def multipart(files: list[tuple[str, bytes]], field: str) -> bytes:
    """A multipart/form-data body (BOUNDARY) with one `field` part per (filename, bytes)."""
    parts = []
    for name, data in files:
        quoted = name.translate({ord('"'): "%22", ord("\r"): "%0D", ord("\n"): "%0A"})  # as browsers do
        kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
        parts.append(f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{field}"; filename="{quoted}"\r\n'
                     f"Content-Type: {kind}\r\n\r\n".encode() + data + b"\r\n")
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def classify_requests(images: list[tuple[str, bytes]], params: dict, files_per_request: int = 1,
                      route: str = "/classify") -> Send:
    """POST `route`, request i carrying `files_per_request` images, round robin from image i x files_per_request:
    as the multipart field `file` when one, else as `files` repeated. The bodies are encoded once, which saves
    40-55% of the client's CPU per request against building an aiohttp.FormData each time."""
    params = {k: str(v) for k, v in params.items() if v is not None}
    field = "file" if files_per_request == 1 else "files"
    # request i's first image is i x files_per_request mod len(images): len(images) bodies cover every request
    bodies = [multipart([images[(i * files_per_request + j) % len(images)] for j in range(files_per_request)], field)
              for i in range(len(images))]
    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}

    async def send(session: aiohttp.ClientSession, i: int) -> int:
        async with session.post(route, data=bodies[i % len(bodies)], params=params, headers=headers) as r:
            await r.read()
            return r.status

    return send


def v2_body(name: str, x: np.ndarray, binary_outputs: bool = True, parameters: dict | None = None
            ) -> tuple[bytes, dict[str, str]]:
    """A KServe v2 infer body with the batch `x` as input `name` in the binary tensor extension (tritonclient's
    encoding), and its headers; outputs asked for in binary too, unless `binary_outputs` is off; `parameters`: the
    request's others (Triton's `timeout`, say)."""
    datatype = DATATYPES[x.dtype]
    blob = np.ascontiguousarray(x, dtype=x.dtype.newbyteorder("<")).tobytes()
    header = json.dumps({"inputs": [{"name": name, "datatype": datatype, "shape": list(x.shape),
                                     "parameters": {"binary_data_size": len(blob)}}],
                         "parameters": {"binary_data_output": binary_outputs, **(parameters or {})}}).encode()
    return header + blob, {"Inference-Header-Content-Length": str(len(header)),
                           "Content-Type": "application/octet-stream"}


def v2_requests(model: str, name: str, x: np.ndarray, binary_outputs: bool = True) -> Send:
    """POST /v2/models/MODEL/infer with the batch `x` as input `name` (v2_body); outputs in binary, unless
    `binary_outputs` is off (then the JSON the protocol defaults to)."""
    body, headers = v2_body(name, x, binary_outputs)

    async def send(session: aiohttp.ClientSession, i: int) -> int:
        async with session.post(f"/v2/models/{model}/infer", data=body, headers=headers) as r:
            await r.read()
            return r.status

    return send


def grpc_requests(model: str, name: str, x: np.ndarray) -> Send:
    """ModelInfer with the batch `x` as input `name` in raw_input_contents, serialised once and sent as bytes (the
    answer is left serialised too: the client's CPU goes to the calls); every output comes back."""
    import grpc

    from service.protocol import open_inference_pb2 as pb
    body = pb.ModelInferRequest(model_name=model, inputs=[pb.ModelInferRequest.InferInputTensor(
        name=name, datatype=DATATYPES[x.dtype], shape=x.shape)], raw_input_contents=[x.tobytes()]).SerializeToString()
    calls = {}  # the method's callable on each channel: made once, not per request

    async def send(channel, i: int) -> int | str:
        call = calls.get(channel) or calls.setdefault(channel, channel.unary_unary(GRPC_INFER))  # bytes in and out
        try:
            await call(body)
        except grpc.aio.AioRpcError as e:
            return e.code().name
        return 200

    return send


@asynccontextmanager
async def connection(url: str, concurrency: int) -> AsyncIterator[object]:
    """What the clients send on: an aiohttp session of `concurrency` kept-alive connections, or for a grpc://
    URL one gRPC channel."""
    if url.startswith("grpc://"):
        import grpc
        async with grpc.aio.insecure_channel(url.removeprefix("grpc://")) as channel:
            yield channel
        return
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


def client_bound(cpu_s: list[float], seconds: float) -> bool:
    """Whether any client process (CPU seconds each over a window of `seconds`) kept its core nearly busy."""
    return any(cpu >= CLIENT_BOUND_CORES * seconds for cpu in cpu_s)


def merge(shares: list[Share], concurrency: int, duration: float, files_per_request: int) -> LevelResult:
    """One level's figures from its client processes' parts: sums, and percentiles over all samples."""
    latencies = [ms for share in shares for ms in share.latencies_ms]
    failures = {}
    for share in shares:
        for status, n in share.failures.items():
            failures[status] = failures.get(status, 0) + n
    images, cpu_s = len(latencies) * files_per_request, sum(share.cpu_s for share in shares)
    return LevelResult(concurrency, duration, len(latencies), len(latencies) / duration, images, images / duration,
                       percentiles(latencies), failures, cpu_s, cpu_s / duration,
                       client_bound([share.cpu_s for share in shares], duration))


async def run_clients(url: str, send: Send, concurrency: int, start_at: float, warmup: float,
                      duration: float) -> Share:
    """`concurrency` clients sending back to back from wall-clock time `start_at` (time.time()); what completes
    in the `duration` seconds after `warmup` counts, and this process's CPU time is taken over the same window."""
    latencies, failures = [], {}
    start = time.perf_counter() + start_at - time.time()  # the same instant on this process's clock
    measure_from, stop_at = start + warmup, start + warmup + duration
    await asyncio.sleep(start - time.perf_counter())

    async def cpu_in_window() -> float:
        await asyncio.sleep(measure_from - time.perf_counter())
        begin = time.process_time()
        await asyncio.sleep(stop_at - time.perf_counter())
        return time.process_time() - begin

    async with connection(url, concurrency) as session:

        async def worker(k: int) -> None:
            i = k
            while (now := time.perf_counter()) < stop_at:
                try:
                    status = str(await send(session, i))
                except (aiohttp.ClientError, TimeoutError) as e:
                    status = type(e).__name__
                i += concurrency
                # count what completes inside the window, whenever it started: with many slow requests in
                # flight, counting by start time would miss the work done for those begun in the warm-up
                if not measure_from <= (finished := time.perf_counter()) <= stop_at:
                    continue
                if status == "200":
                    latencies.append((finished - now) * 1e3)
                else:
                    failures[status] = failures.get(status, 0) + 1

        cpu_s, *_ = await asyncio.gather(cpu_in_window(), *(worker(k) for k in range(concurrency)))
    return Share(latencies, failures, cpu_s)


async def run_level(url: str, send: Send, concurrency: int, duration: float, warmup: float = 1.0,
                    files_per_request: int = 1) -> LevelResult:
    """`concurrency` clients in this process sending requests (of `files_per_request` images each) back to back
    until `duration` seconds after the warm-up."""
    share = await run_clients(url, send, concurrency, time.time(), warmup, duration)
    return merge([share], concurrency, duration, files_per_request)


def split(concurrency: int, processes: int) -> list[int]:
    """Clients per process, as even as can be, and no process without any."""
    return [n for k in range(processes) if (n := concurrency // processes + (k < concurrency % processes))]


def client_process(link: Connection, url: str, sender: Sender, concurrency: int, warmup: float,
                   duration: float) -> None:
    """A spawned client: says when it is ready, gets the common start time, sends back its Share."""
    factory, args = sender
    send = factory(*args)
    link.send(None)
    start_at = link.recv()
    link.send(asyncio.run(run_clients(url, send, concurrency, start_at, warmup, duration)))


def receive(link: Connection) -> object:
    """The next message from a client process, or an error when it died first."""
    try:
        return link.recv()
    except EOFError:
        raise RuntimeError("a client process died (its traceback is above)") from None


def run_level_processes(url: str, sender: Sender, concurrency: int, duration: float, processes: int,
                        warmup: float = 1.0, files_per_request: int = 1) -> LevelResult:
    """run_level with the clients split over `processes` spawned processes, which rebuild the Send from `sender`
    (e.g. `(classify_requests, (images, params, files))`) and all count the same wall-clock window."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no event loop or socket copied by fork
    links, workers = [], []
    for n in split(concurrency, processes):
        ours, theirs = context.Pipe()
        workers.append(context.Process(target=client_process, daemon=True,
                                       args=(theirs, url, sender, n, warmup, duration)))
        workers[-1].start()
        theirs.close()  # ours alone holds the pipe open now: a client that dies ends it, and recv raises
        links.append(ours)
    for link in links:
        receive(link)
    # every process has started and imported what it needs, so the window lies ahead of all of them
    start_at = time.time() + 0.05
    for link in links:
        link.send(start_at)
    shares = [receive(link) for link in links]
    for worker in workers:
        worker.join()
    return merge(shares, concurrency, duration, files_per_request)


def default_images() -> list[tuple[str, bytes]]:
    """scikit-image's photographs as JPEG, when it is installed."""
    try:
        from PIL import Image
        from skimage import data
    except ImportError:
        raise SystemExit("error: pass --image FILE (or install scikit-image for its built-in photographs)") from None
    out = []
    for name in ("chelsea", "astronaut", "coffee", "rocket"):
        buf = io.BytesIO()
        Image.fromarray(getattr(data, name)()).save(buf, format="JPEG", quality=90)
        out.append((f"{name}.jpg", buf.getvalue()))
    return out


def table(results: list[LevelResult]) -> str:
    rows = [f"{'concurrency':>11} {'images/s':>9} {'requests/s':>10} {'p50 ms':>8} {'p90 ms':>8} {'p95 ms':>8} "
            f"{'p99 ms':>8} {'client cores':>12} {'CPU ms/image':>12}  failures"]
    for r in results:
        lat = r.latency_ms or {k: float("nan") for k in ("p50", "p90", "p95", "p99")}
        fails = ", ".join(f"{k}: {v}" for k, v in sorted(r.failures.items())) or "-"
        cpu_ms = r.client_cpu_s * 1e3 / r.images if r.images else float("nan")
        rows.append(f"{r.concurrency:>11} {r.images_per_s:>9.1f} {r.requests_per_s:>10.1f} {lat['p50']:>8.1f} "
                    f"{lat['p90']:>8.1f} {lat['p95']:>8.1f} {lat['p99']:>8.1f} {r.client_cores:>12.2f} "
                    f"{cpu_ms:>12.3f}  {fails}" + ("  CLIENT-BOUND" if r.client_bound else ""))
    return "\n".join(rows)


def plot(results: list[LevelResult], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r.concurrency for r in results]
    fig, left = plt.subplots(figsize=(7, 4))
    left.plot(xs, [r.images_per_s for r in results], "o-", color="tab:blue")
    if bound := [r for r in results if r.client_bound]:
        left.plot([r.concurrency for r in bound], [r.images_per_s for r in bound], "kx", markersize=10,
                  label="client-bound")
        left.legend(loc="lower right")
    left.set_xscale("log", base=2)
    left.set_xlabel("concurrent clients")
    left.set_ylabel("images / s", color="tab:blue")
    right = left.twinx()
    for p, style in (("p50", "s--"), ("p95", "^--"), ("p99", "v:")):
        right.plot(xs, [r.latency_ms.get(p, float("nan")) for r in results], style, color="tab:red", label=p)
    right.set_ylabel("latency ms per request", color="tab:red")
    right.legend(loc="upper left")
    left.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def v2_sender(url: str, model: str | None, datatype: str, batch: int, grpc: bool = False) -> Sender:
    """Random tensors of `model`'s input of that datatype, from its v2 metadata (read over HTTP), for /v2 infer or,
    with `grpc`, for ModelInfer."""
    if model is None:
        raise SystemExit("error: --v2 needs --model")
    import urllib.request
    with urllib.request.urlopen(f"{url}/v2/models/{model}") as r:
        metadata = json.load(r)
    inputs = metadata["inputs"] + metadata.get("parameters", {}).get("other_inputs", [])  # vitserve's pixel_values
    wanted = next(i for i in inputs if i["datatype"] == datatype)
    shape = [batch, *wanted["shape"][1:]]
    rng = np.random.default_rng(0)
    x = rng.random(shape, np.float32) if datatype == "FP32" else rng.integers(0, 256, shape, np.uint8)
    return (grpc_requests if grpc else v2_requests), (model, wanted["name"], x)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m service.loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://localhost:8000")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated client counts")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per level")
    p.add_argument("--model", help="model name (default: the server's default)")
    p.add_argument("--image", type=Path, action="append", help="image file(s) to send (default: sample photos)")
    p.add_argument("--files-per-request", type=int, default=1, help="images per request (several: field `files`)")
    p.add_argument("--processes", type=int, default=1, help="client processes to split each level's clients over")
    p.add_argument("--v2", choices=["FP32", "UINT8"], help="send random tensors to /v2 infer instead (needs --model)")
    p.add_argument("--grpc", metavar="HOST:PORT", help="send the --v2 tensors over gRPC, to ModelInfer at HOST:PORT")
    p.add_argument("--plot", type=Path, help="save throughput and latency vs concurrency as an image")
    p.add_argument("--json", type=Path, help="save the results as JSON")
    args = p.parse_args(argv)
    files = args.files_per_request
    if args.grpc and not args.v2:
        raise SystemExit("error: --grpc sends tensors: give their datatype with --v2 FP32|UINT8")
    target = f"grpc://{args.grpc}" if args.grpc else args.url
    images = [(f.name, f.read_bytes()) for f in args.image] if args.image else None
    sender = (v2_sender(args.url, args.model, args.v2, files, args.grpc is not None) if args.v2 else
              (classify_requests, (images or default_images(), {"model": args.model, "top_k": 1}, files)))
    results = []
    for c in (int(x) for x in args.concurrency.split(",")):
        send = sender[0](*sender[1])
        results.append(asyncio.run(run_level(target, send, c, args.duration, files_per_request=files))
                       if args.processes == 1 else
                       run_level_processes(target, sender, c, args.duration, args.processes, files_per_request=files))
        print(table(results[-1:]).splitlines()[-1] if len(results) > 1 else table(results), flush=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    if args.plot:
        per_request = f", {files} images per request" if files > 1 else ""
        plot(results, args.plot, f"vitserve {args.model or 'default model'} at {target}{per_request}")
        print(f"plot: {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
