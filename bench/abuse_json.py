"""What large /v2 JSON bodies cost the other clients: /classify latency while clients post ~16 MB JSON tensors.

    python bench/abuse_json.py                          # thread backend, 6 flooding clients, 10 s
    python bench/abuse_json.py --backend process --clients 6 --seconds 10 --mb 15.5

One `python -m service` on loopback (default settings: a 16 MiB body limit). First one client alone times
POST /classify (the chelsea JPEG, shapes-deit) back to back; then, for as long, `--clients` clients post a /v2
infer of `--mb` MB of JSON each, again and again (FP32 pixel values written as Python writes floats, ~19
characters each: a few images, so that parsing, not inference, is their cost), while the same client times
/classify. The service's resident memory (process_resident_memory_bytes, every process added up) is sampled every
0.2 s. Each client is a thread of this process: sending and receiving release the GIL, so the timing client is
not held up by the flooding ones here.
"""
import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from service_process import photo_bytes, process_metrics, running_service  # noqa: E402

MODEL = "shapes-deit"


def json_body(mb: float, valid: bool) -> bytes:
    """A /v2 JSON request of about `mb` MB: pixel_values of as many 96 x 96 images as fit; unless `valid`, one
    value short of its shape, so that it is parsed whole and refused (400) before any inference."""
    image = np.random.default_rng(0).standard_normal((1, 3, 96, 96)).astype(np.float32)
    per_image = len(json.dumps(image.ravel().tolist())) + 1
    x = np.repeat(image, max(1, int(mb * 1e6 // per_image)), axis=0)
    data = x.ravel().tolist()
    return json.dumps({"inputs": [{"name": "pixel_values", "shape": list(x.shape), "datatype": "FP32",
                                   "data": data if valid else data[:-1]}], "outputs": [{"name": "logits"}]}).encode()


def time_classify(url: str, until: float) -> list[float]:
    jpeg, waits = photo_bytes("chelsea", "JPEG"), []
    with httpx.Client(timeout=60) as client:
        client.post(f"{url}/classify", params={"model": MODEL}, files={"file": ("a.jpg", jpeg)})  # connected
        while time.perf_counter() < until:
            start = time.perf_counter()
            r = client.post(f"{url}/classify", params={"model": MODEL}, files={"file": ("a.jpg", jpeg)})
            r.raise_for_status()
            waits.append((time.perf_counter() - start) * 1e3)
    return waits


def flood(url: str, body: bytes, until: float, statuses: list[int]) -> None:
    with httpx.Client(timeout=120) as client:
        while time.perf_counter() < until:
            statuses.append(client.post(f"{url}/v2/models/{MODEL}/infer", content=body,
                                        headers={"Content-Type": "application/json"}).status_code)


def rss_mb(url: str) -> float:
    return process_metrics(httpx.get(f"{url}/metrics", timeout=30).text)["process_resident_memory_bytes"] / 2**20


def summary(name: str, waits: list[float]) -> str:
    q = statistics.quantiles(waits, n=100, method="inclusive") if len(waits) > 1 else waits * 99
    return (f"{name:<28} {len(waits):>5} requests  p50 {q[49]:7.1f} ms  p99 {q[98]:7.1f} ms  "
            f"max {max(waits):7.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="thread", choices=["thread", "process"])
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--mb", type=float, default=15.5, help="size of each JSON body, MB")
    p.add_argument("--valid", action="store_true", help="tensors the model runs (their inference loads the "
                                                        "same model /classify uses): else refused once parsed")
    args = p.parse_args()
    body = json_body(args.mb, args.valid)
    with running_service(backend=args.backend, workers=2) as url:
        alone = time_classify(url, time.perf_counter() + args.seconds)
        before, peak, statuses = rss_mb(url), 0.0, []
        until = time.perf_counter() + args.seconds
        flooders = [threading.Thread(target=flood, args=(url, body, until, statuses)) for _ in range(args.clients)]
        for thread in flooders:
            thread.start()
        sampling = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not sampling.wait(0.2):
                peak = max(peak, rss_mb(url))

        sampler = threading.Thread(target=sample)
        sampler.start()
        flooded = time_classify(url, until)
        for thread in flooders:
            thread.join()
        sampling.set()
        sampler.join()
    print(f"{args.backend} backend; {args.clients} clients posting {len(body) / 1e6:.1f} MB of /v2 JSON each"
          + (" (valid tensors)" if args.valid else " (parsed, then refused)"))
    print(summary("/classify alone", alone))
    print(summary("/classify during the flood", flooded))
    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
    print(f"JSON requests answered: {len(statuses)} in {args.seconds:g} s, by status {counts}")
    print(f"resident memory: {before:.0f} MB before the flood, {peak:.0f} MB at its peak (sampled every 0.2 s)")


if __name__ == "__main__":
    main()
