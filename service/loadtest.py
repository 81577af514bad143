"""Load-test a running vitserve: images/sec and latency percentiles per concurrency level.

    python -m service.loadtest --url http://localhost:8000 --concurrency 1,4,16,64
    python -m service.loadtest --url http://localhost:8000 --model shapes-swin --image cat.jpg --plot load.png

Each level runs `--concurrency` clients, each sending one image per request back to back over a kept-alive
connection, for `--duration` seconds after a short warm-up. Reported per level: successful images/sec,
p50/p90/p95/p99 latency, and failures by status (a 503 from a full queue counts as a failure).

The client is aiohttp: it costs about 0.35 ms of CPU per request where httpx's pool costs 2 ms at 8 connections
and 6 ms at 32, and a load tester on the server's own cores must not eat the throughput it measures.
"""
import argparse
import asyncio
import io
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

# sends request number i (one image) on the session and returns its HTTP status
Send = Callable[[aiohttp.ClientSession, int], Awaitable[int]]


@dataclass
class LevelResult:
    concurrency: int
    seconds: float
    images: int
    images_per_s: float
    latency_ms: dict[str, float]
    failures: dict[str, int] = field(default_factory=dict)


def percentiles(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {}
    cuts = statistics.quantiles(samples, n=100, method="inclusive") if len(samples) > 1 else samples * 99
    return {"p50": cuts[49], "p90": cuts[89], "p95": cuts[94], "p99": cuts[98], "mean": statistics.fmean(samples)}


def classify_requests(images: list[tuple[str, bytes]], params: dict) -> Send:
    """POST /classify, request i carrying image i (round robin) as the multipart field `file`."""
    params = {k: str(v) for k, v in params.items() if v is not None}

    async def send(session: aiohttp.ClientSession, i: int) -> int:
        name, data = images[i % len(images)]
        form = aiohttp.FormData()
        form.add_field("file", data, filename=name)
        async with session.post("/classify", data=form, params=params) as r:
            await r.read()
            return r.status

    return send


async def run_level(url: str, send: Send, concurrency: int, duration: float, warmup: float = 1.0) -> LevelResult:
    """`concurrency` clients sending requests back to back until `duration` seconds after the warm-up."""
    latencies, failures = [], {}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        start = time.perf_counter()
        measure_from, stop_at = start + warmup, start + warmup + duration

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

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return LevelResult(concurrency, duration, len(latencies), len(latencies) / duration, percentiles(latencies),
                       failures)


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
    rows = [f"{'concurrency':>11} {'images/s':>9} {'p50 ms':>8} {'p90 ms':>8} {'p95 ms':>8} {'p99 ms':>8}  failures"]
    for r in results:
        lat = r.latency_ms or {k: float("nan") for k in ("p50", "p90", "p95", "p99")}
        fails = ", ".join(f"{k}: {v}" for k, v in sorted(r.failures.items())) or "-"
        rows.append(f"{r.concurrency:>11} {r.images_per_s:>9.1f} {lat['p50']:>8.1f} {lat['p90']:>8.1f} "
                    f"{lat['p95']:>8.1f} {lat['p99']:>8.1f}  {fails}")
    return "\n".join(rows)


def plot(results: list[LevelResult], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r.concurrency for r in results]
    fig, left = plt.subplots(figsize=(7, 4))
    left.plot(xs, [r.images_per_s for r in results], "o-", color="tab:blue")
    left.set_xscale("log", base=2)
    left.set_xlabel("concurrent clients")
    left.set_ylabel("images / s", color="tab:blue")
    right = left.twinx()
    for p, style in (("p50", "s--"), ("p95", "^--"), ("p99", "v:")):
        right.plot(xs, [r.latency_ms.get(p, float("nan")) for r in results], style, color="tab:red", label=p)
    right.set_ylabel("latency ms", color="tab:red")
    right.legend(loc="upper left")
    left.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m service.loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://localhost:8000")
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated client counts")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per level")
    p.add_argument("--model", help="model name (default: the server's default)")
    p.add_argument("--image", type=Path, action="append", help="image file(s) to send (default: sample photos)")
    p.add_argument("--plot", type=Path, help="save throughput and latency vs concurrency as an image")
    p.add_argument("--json", type=Path, help="save the results as JSON")
    args = p.parse_args(argv)
    images = [(f.name, f.read_bytes()) for f in args.image] if args.image else default_images()
    params = {"model": args.model, "top_k": 1} if args.model else {"top_k": 1}
    results = []
    for c in (int(x) for x in args.concurrency.split(",")):
        results.append(asyncio.run(run_level(args.url, classify_requests(images, params), c, args.duration)))
        print(table(results[-1:]).splitlines()[-1] if len(results) > 1 else table(results), flush=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    if args.plot:
        plot(results, args.plot, f"vitserve {args.model or 'default model'} at {args.url}")
        print(f"plot: {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
