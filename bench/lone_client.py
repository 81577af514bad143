"""A lone client's `/classify` p50 against what the work itself takes: the upload decoded and one batch-1 session run,
timed in this process (the service's own functions and thread settings), rounds interleaved with wrk's runs.
Issue 56's target: p50 ≤ 1.2× the direct time.

    python bench/lone_client.py                      # shapes-deit, thread backend, 3 rounds of 5 s
    python bench/lone_client.py --backend process --rounds 5
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT, ROOT / "tests", ROOT / "bench"):
    sys.path.insert(0, str(folder))
import wrk  # noqa: E402
from service_process import photo_bytes, service_and_process  # noqa: E402

from repository import read_entry  # noqa: E402
from service.engine.backends.lifecycle import input_names  # noqa: E402
from service.images.decode import upload_input  # noqa: E402
from service.engine.runtime import CPU, Runner  # noqa: E402
from service.core.settings import Settings  # noqa: E402


def direct_ms(runner: Runner, policy, jpeg: bytes, max_pixels: int, runs: int = 300) -> float:
    """Median ms of decoding the JPEG into a batch of one and running it."""
    h, w = policy.size
    no_tensors, times = np.zeros((0, 3, h, w), np.float32), []
    for _ in range(runs):
        start = time.perf_counter()
        images = runner.host_batch(1)
        images[0] = upload_input(jpeg, policy, max_pixels)
        runner.run(images, no_tensors)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="shapes-deit")
    p.add_argument("--backend", default="thread", choices=["thread", "process"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=int, default=5)
    args = p.parse_args()
    if not wrk.available():
        raise SystemExit("wrk is not installed: apt-get install wrk")
    repo, settings = ROOT / "model_repository", Settings()
    entry = read_entry(repo / args.model)
    runner = Runner(entry.path(), input_names(entry), [CPU], settings.intra_op_threads, settings.spin_wait)
    jpeg = photo_bytes("chelsea", "JPEG", quality=90)
    request = wrk.classify_request(jpeg, 1, query=f"model={args.model}&top_k=1")
    ratios = []
    with service_and_process(model_repository=repo, backend=args.backend, access_log=False) as (url, _):
        wrk.run(url, request, 1, 2)  # warm
        for r in range(args.rounds):
            direct = direct_ms(runner, entry.policy, jpeg, settings.max_image_pixels)
            figures = wrk.run(url, request, 1, args.seconds)
            ratios.append(figures.p50_ms / direct)
            print(f"round {r + 1}: decode + batch-1 run {direct:.2f} ms; service p50 {figures.p50_ms:.2f} ms "
                  f"({figures.requests_per_s:.0f}/s): {ratios[-1]:.2f}x", flush=True)
    print(f"{args.model}, {args.backend} backend: a lone client's p50 is {statistics.median(ratios):.2f}x the direct "
          f"time (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
