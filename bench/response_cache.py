"""What the response cache saves on a repeated image: the same /classify request (the 451 x 300 chelsea JPEG on
shapes-vit, the embedded ViT) to a service with VITSERVE_RESPONSE_CACHE_BYTES off and to one with it on, served
side by side (process backend, one HTTP worker each), wrk on the same cores, rounds interleaved, medians.

    python bench/response_cache.py
    python bench/response_cache.py --clients 1 32 --rounds 5 --seconds 8

Every request after the first is a hit where the cache is on: the figures are the ceiling of what it saves, which
a real mix of repeated and new uploads approaches as its hit rate does. CPU per request from /proc, by process
(bench/http_floor.py's reader): the HTTP worker's and the inference process's.
"""
import argparse
import os
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
import wrk  # noqa: E402
from http_floor import cpu_reader, measure  # noqa: E402
from service_process import photo_bytes, service_and_process  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", nargs="+", type=int, default=[1, 32], help="wrk connections")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if not wrk.available():
        raise SystemExit("wrk is not installed: apt-get install wrk")
    request = wrk.classify_request(photo_bytes("chelsea", "JPEG", quality=90), 1, query="model=shapes-vit&top_k=5")
    runs: dict[tuple[str, int], list[dict]] = {}
    with ExitStack() as stack:
        servers = {}
        for name, cache_bytes in (("cache off", 0), ("cache on", 64 * 2**20)):
            url, proc = stack.enter_context(service_and_process(
                backend="process", workers=1, access_log=False, response_cache_bytes=cache_bytes))
            servers[name] = (url, cpu_reader("process", proc.pid))
            wrk.run(url, request, max(args.clients), 1)  # warm-up (and the one miss)
        for _ in range(args.rounds):
            for clients in args.clients:
                for name, (url, read) in servers.items():
                    runs.setdefault((name, clients), []).append(measure(url, read, request, clients, args.seconds))
    print(f"/classify, the same JPEG each time, shapes-vit, process backend with one HTTP worker, wrk on the same "
          f"{os.cpu_count()} cores; medians of {args.rounds} rounds of {args.seconds:g}s")
    print(f"{'server':<10} {'clients':>7} {'req/s':>7} {'p50 ms':>6} {'errors':>6} | {'worker ms/req':>13} "
          f"{'inference ms/req':>16}")
    for (name, clients), rounds in runs.items():
        m = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        print(f"{name:<10} {clients:>7} {m['requests_per_s']:>7,.0f} {m['p50']:>6.2f} {m['errors']:>6.0f} | "
              f"{m['http']:>13.3f} {m['inference']:>16.3f}")


if __name__ == "__main__":
    main()
