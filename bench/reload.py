"""A model reloaded under load: request latency while the switch happens against the steady state, and the
service's memory before, during and after (the old session let go).

A copy of the repository serves MODEL (--first, default shapes-vit) with VITSERVE_MODEL_CONTROL=explicit;
--clients threads classify a JPEG with it without pause; every --gap seconds the other graph (--second, default
shapes-vit-int8: the same layout, its own answers) is written into the model's folder and loaded, --reloads times,
alternating. A request belongs to the switch when it was sent between the load call and 0.5 s after its answer;
the others are the steady state. Memory is the service's resident set from /metrics (all its processes), before
the first reload and after each one.

    python bench/reload.py
    python bench/reload.py --backend process
    python bench/reload.py --first /tmp/big/deit-fp32 --second /tmp/big/deit-int8   # a session worth seeing in RSS
"""
import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from service_process import metric, photo_bytes, running_service, write_model  # noqa: E402

JPEG = photo_bytes("chelsea", "JPEG")


def resident_mb(url: str) -> float:
    return metric(httpx.get(f"{url}/metrics").text, "process_resident_memory_bytes") / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--first", type=Path, default=ROOT / "model_repository" / "shapes-vit")
    p.add_argument("--second", type=Path, default=ROOT / "model_repository" / "shapes-vit-int8")
    p.add_argument("--backend", choices=["thread", "process"], default="thread")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--reloads", type=int, default=6)
    p.add_argument("--gap", type=float, default=3.0, help="seconds of steady load before each reload")
    args = p.parse_args()
    name = json.loads((args.first / "manifest.json").read_text())["name"]
    with tempfile.TemporaryDirectory() as repository:
        folder = Path(repository) / name
        shutil.copytree(args.first, folder)
        settings = {"model_repository": repository, "model_control": "explicit", "backend": args.backend}
        with running_service(**settings) as url:
            sent_at, latency, errors, stop = [], [], [], threading.Event()

            def client() -> None:
                with httpx.Client(timeout=60) as session:
                    while not stop.is_set():
                        start = time.monotonic()
                        r = session.post(f"{url}/classify", params={"model": name}, files={"file": ("a.jpg", JPEG)})
                        sent_at.append(start)
                        latency.append((time.monotonic() - start) * 1e3)
                        if r.status_code != 200:
                            errors.append(r.status_code)

            threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
            for thread in threads:
                thread.start()
            switches, memory = [], [("before", resident_mb(url))]
            for i in range(args.reloads):
                time.sleep(args.gap)
                write_model(folder, args.second if i % 2 == 0 else args.first, name)
                began = time.monotonic()
                r = httpx.post(f"{url}/v2/repository/models/{name}/load", timeout=300)
                r.raise_for_status()
                switches.append((began, time.monotonic() + 0.5, time.monotonic() - began))
                time.sleep(0.5)
                memory.append((f"after reload {i + 1}", resident_mb(url)))
            time.sleep(args.gap)
            stop.set()
            for thread in threads:
                thread.join()
    sent, ms = np.array(sent_at), np.array(latency)
    during = np.zeros(len(sent), bool)
    for began, ended, _ in switches:
        during |= (sent >= began) & (sent <= ended)
    steady, switching = ms[~during], ms[during]
    print(f"{name} on the {args.backend} backend, {args.clients} clients, {args.reloads} reloads "
          f"(each {statistics.median(s[2] for s in switches):.2f} s, median), {len(ms)} requests, "
          f"{len(errors)} not 200")
    print("| requests | n | p50 ms | p99 ms |\n|---|---|---|---|")
    for label, values in (("steady", steady), ("during a switch", switching)):
        print(f"| {label} | {len(values)} | {np.percentile(values, 50):.1f} | {np.percentile(values, 99):.1f} |")
    print(f"p99 during a switch / steady p99: {np.percentile(switching, 99) / np.percentile(steady, 99):.2f}")
    print("resident memory, MB: " + ", ".join(f"{label} {mb:.0f}" for label, mb in memory))


if __name__ == "__main__":
    main()
