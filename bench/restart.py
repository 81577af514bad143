"""How long a killed inference process takes to serve again: the service (process backend) on the embedded model
repository, its inference process SIGKILLed --times times, each time timed until its replacement is up and until
/classify answers 200 again, on whatever device the service picks (CUDA on a GPU host: issue 77's target is 15 s).

    python bench/restart.py --times 3
"""
import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from process_cost import INFERENCE, supervisor_pid  # noqa: E402
from service_process import photo_bytes, role_pids, running_service  # noqa: E402


def until(condition, timeout_s: float) -> float:
    """Seconds until `condition()` held (polled every 20 ms); a failure past `timeout_s`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise SystemExit(f"not within {timeout_s:g} s")
        time.sleep(0.02)
    return time.monotonic() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--times", type=int, default=3)
    p.add_argument("--model", default="shapes-deit")
    args = p.parse_args()
    photo = {"file": ("a.jpg", photo_bytes("chelsea", "JPEG"))}

    def answers() -> bool:
        try:
            return httpx.post(f"{url}/classify", files=photo, params={"model": args.model}, timeout=10).is_success
        except httpx.HTTPError:
            return False

    with running_service(backend="process", workers=2) as url:
        supervisor = supervisor_pid(int(url.rsplit(":", 1)[1]))
        model = next(m for m in httpx.get(f"{url}/models", timeout=10).json()["models"] if m["name"] == args.model)
        print(f"bench/restart.py: {args.model} on {model['provider']} ({model['precision']}), process backend, "
              "2 HTTP workers; seconds from SIGKILL of the inference process", flush=True)
        started, served = [], []
        for _ in range(args.times):
            (victim,) = role_pids(supervisor, INFERENCE)
            killed = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            until(lambda: [p for p in role_pids(supervisor, INFERENCE) if p != victim], 120)
            started.append(time.monotonic() - killed)
            until(answers, 300)
            served.append(time.monotonic() - killed)
            print(f"  replacement started {started[-1]:.1f} s, /classify 200 again {served[-1]:.1f} s", flush=True)
        print(f"median: started {statistics.median(started):.1f} s, serving {statistics.median(served):.1f} s "
              f"(min {min(served):.1f}, max {max(served):.1f})")


if __name__ == "__main__":
    main()
