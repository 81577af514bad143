"""Seconds from `python -m service` to /health/ready 200 on the embedded models (VITSERVE_CPU_PLAN=auto): the first
start on a host, with nothing kept in a new VITSERVE_CPU_PLAN_DIR, then a second start that finds the plans kept.

    python bench/start_time.py                       # this checkout
    python bench/start_time.py --root /tmp/old       # another one (a git worktree of an older commit), to compare
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from service_process import service_and_process  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=ROOT, help="the checkout whose service starts (default: this one)")
    p.add_argument("--backend", default="thread")
    args = p.parse_args()
    plans = tempfile.mkdtemp(prefix="vitserve-cpu-plans-")
    for label in ("first start (nothing kept)", "second start"):
        start = time.monotonic()
        with service_and_process(root=args.root, cpu_plan="auto", cpu_plan_dir=plans, backend=args.backend):
            print(f"{args.root}: {label}: ready after {time.monotonic() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
