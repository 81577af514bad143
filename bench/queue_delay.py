"""Images/sec of one model at each max_queue_delay_ms, interleaved: what waiting for a batch to fill buys.

    python bench/queue_delay.py                                   # shapes-deit, delays 0 1 2 5 ms
    python bench/queue_delay.py --model shapes-swin --delays 0 5 20 --levels 1 16

One `python -m service` per delay, all on the embedded repository; each round measures every (clients, route,
delay) once, so drift hits all delays alike; the figures are medians over rounds. Routes: /classify with the
chelsea JPEG, and /v2 infer with the same image preprocessed (no decoding).
"""
import argparse
import asyncio
import contextlib
import json
import statistics
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from repository import InputPolicy  # noqa: E402
from service.loadtest import classify_requests, run_level, v2_requests  # noqa: E402
from service_process import model_pixels, photo_bytes, running_service  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="shapes-deit")
    p.add_argument("--delays", nargs="+", type=float, default=[0, 1, 2, 5])
    p.add_argument("--levels", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=4.0)
    args = p.parse_args()
    manifest = json.loads((ROOT / "model_repository" / args.model / "manifest.json").read_text())
    jpeg = photo_bytes("chelsea", "JPEG", quality=90)
    pixels = model_pixels(ROOT / "model_repository" / args.model, jpeg)
    x = InputPolicy.from_manifest(manifest["input"]).normalise(pixels[None])
    routes = {"classify": classify_requests([("chelsea.jpg", jpeg)], {"model": args.model, "top_k": 1}),
              "v2": v2_requests(args.model, manifest["tensor_input"]["name"], x)}
    figures: dict[tuple, list[float]] = {}
    with contextlib.ExitStack() as stack:
        urls = {d: stack.enter_context(running_service(max_queue_delay_ms=d, warmup_runs=1)) for d in args.delays}
        for _ in range(args.rounds):
            for c in args.levels:
                for route, send in routes.items():
                    for d in args.delays:
                        level = asyncio.run(run_level(urls[d], send, c, args.seconds))
                        figures.setdefault((c, route, d), []).append(level.images_per_s)
    print(f"{args.model}: images/s by max_queue_delay_ms, medians of {args.rounds} rounds of {args.seconds:g}s")
    print(f"{'clients':>7} {'route':<9}" + "".join(f"{f'{d:g} ms':>10}" for d in args.delays))
    for c in args.levels:
        for route in routes:
            medians = [statistics.median(figures[c, route, d]) for d in args.delays]
            print(f"{c:>7} {route:<9}" + "".join(f"{m:>10.1f}" for m in medians))


if __name__ == "__main__":
    main()
