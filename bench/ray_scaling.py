"""One `python -m service` vs the same service on Ray Serve replicas, on this machine, in images/sec.

    python bench/ray_scaling.py                      # shapes-deit; 8 and 32 clients
    python bench/ray_scaling.py --model shapes-swin --levels 16 --rounds 5

Variants: the plain service (uvicorn, ONNX Runtime on every core); Ray Serve with one replica on every core
(what Ray's proxy costs); Ray Serve with one replica per core, one ONNX Runtime thread each (what splitting
a host into replicas gives). Every request is one JPEG photo (chelsea) on /classify, from the load tester on
the same machine. Each round measures every (clients, variant) once; figures are medians over rounds.
"""
import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from service.loadtest import classify_requests, run_level  # noqa: E402
from service_process import photo_bytes, running_ray_service, running_service  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="shapes-deit")
    p.add_argument("--levels", nargs="+", type=int, default=[8, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=6.0)
    args = p.parse_args()
    cores = os.cpu_count() or 1
    jpeg = photo_bytes("chelsea", "JPEG", quality=90)
    send = classify_requests([("chelsea.jpg", jpeg)], {"model": args.model, "top_k": 1})
    figures: dict[tuple, list[float]] = {}
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        urls = {"plain service": stack.enter_context(running_service(warmup_runs=1))}
        # all three run throughout, so that rounds can alternate: each `python -m service.ray_serve` starts
        # its own local Ray, whose background processes take a little CPU from whichever variant is measured
        for name, replicas, cpus in ((f"ray 1 replica x {cores} CPU", 1, cores),
                                     (f"ray {cores} replicas x 1 CPU", cores, 1)):
            urls[name], _ = stack.enter_context(
                running_ray_service(replicas, logs / f"{replicas}.log", cpus_per_replica=cpus, warmup_runs=1))
        for _ in range(args.rounds):
            for c in args.levels:
                for name, url in urls.items():
                    level = asyncio.run(run_level(url, send, c, args.seconds))
                    figures.setdefault((c, name), []).append(level.images_per_s)
    print(f"{args.model}, /classify with one JPEG per request, {cores} CPU cores, medians of {args.rounds} rounds "
          f"of {args.seconds:g}s (images/s)")
    print(f"{'clients':>7}" + "".join(f"{name:>26}" for name in urls))
    for c in args.levels:
        plain = statistics.median(figures[c, "plain service"])
        cells = [f"{statistics.median(figures[c, n]):>9.1f} ({statistics.median(figures[c, n]) / plain:>4.0%})"
                 for n in urls]
        print(f"{c:>7}" + "".join(f"{cell:>26}" for cell in cells))


if __name__ == "__main__":
    main()
