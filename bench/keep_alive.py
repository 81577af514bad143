"""The keep-alive race: clients that reuse a connection idle about as long as the server keeps one open.

    python bench/keep_alive.py                       # idle closes at 5 s (uvicorn's default before) against 60 s
    python bench/keep_alive.py --rounds 2 --seconds 60 --idle 5

A server that closes an idle connection while a client sends a request on it gives that client a reset or no
answer at all (httpx: ReadError, RemoteProtocolError), and a POST is not retried. httpx keeps an idle connection
5 s, counted from when it has read the answer, later than the server's clock starts; uvicorn closed idle ones after
5 s too. Here, `python -m service` (thread backend) on loopback, with an idle connection closed after `--idle`
seconds (VITSERVE_HEADER_TIMEOUT_S, which the service's keep-alive follows) and after 60 s, interleaved: 12 clients
keep it busy with /classify (4 photos each), and 150 clients each reuse one connection after an idle time drawn
between `--idle` - 0.15 s and `--idle` + 0.05 s, again and again. Printed: reuses and failures per setting.
"""
import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from service_process import photo_bytes, running_service  # noqa: E402


async def race(url: str, seconds: float, idle: float) -> tuple[int, list[str]]:
    """(reuses, the failures' names) of connections reused after about `idle` seconds, the server kept busy."""
    jpeg, end, reuses, failures = photo_bytes("chelsea", "JPEG"), time.monotonic() + seconds, 0, []

    async def busy() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            while time.monotonic() < end:
                await client.post(f"{url}/classify", files=[("files", (f"{k}.jpg", jpeg)) for k in range(4)],
                                  params={"model": "shapes-deit"})

    async def reuse() -> None:
        nonlocal reuses
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(keepalive_expiry=3600)) as client:
            await client.get(f"{url}/health/live")
            while time.monotonic() < end:
                await asyncio.sleep(random.uniform(idle - 0.15, idle + 0.05))
                try:
                    await client.get(f"{url}/health/live")
                    reuses += 1
                except httpx.TransportError as e:
                    failures.append(type(e).__name__)

    await asyncio.gather(*(busy() for _ in range(12)), *(reuse() for _ in range(150)))
    return reuses, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--idle", type=float, default=5.0, help="the short idle close, and the clients' idle time")
    parser.add_argument("--seconds", type=float, default=60.0, help="per round and setting")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    totals = {args.idle: [0, []], 60.0: [0, []]}
    for _ in range(args.rounds):
        for close_after, total in totals.items():
            with running_service(backend="thread", header_timeout_s=close_after) as url:
                reuses, failures = asyncio.run(race(url, args.seconds, args.idle))
            total[0] += reuses
            total[1] += failures
            print(f"idle close {close_after:g} s: {reuses} reuses, {len(failures)} failed "
                  f"({', '.join(sorted(set(failures))) or '-'})", flush=True)
    for close_after, (reuses, failures) in totals.items():
        print(f"in all, idle close {close_after:g} s: {len(failures)} of {reuses + len(failures)} reuses failed")


if __name__ == "__main__":
    main()
