"""What the HTTP service costs on top of the bare ONNX Runtime session, in images/sec.

    python bench/service_overhead.py                 # the embedded default model and a full-size DeiT-S
    python bench/service_overhead.py --models shapes-deit --seconds 5 --rounds 3

raw(c): one session (the server's thread settings) on batches of min(c, max batch size) preprocessed images,
        what a server with zero overhead would reach with c clients.
http(c): c concurrent clients, one JPEG photo (chelsea, 451 x 300) per request to a real `python -m service`,
        decoding and preprocessing included, the client on the same machine.
Raw and HTTP measurements alternate, round by round; the figures are medians over rounds. Service settings
come from the environment as usual (e.g. VITSERVE_SPIN_WAIT=true), and the raw session follows them.
"""
import argparse
import asyncio
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image
from skimage import data as photos

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from service.loadtest import run_level  # noqa: E402
from service.preprocess import InputPolicy, prepare  # noqa: E402
from service.runtime import Runner  # noqa: E402
from service.settings import Settings  # noqa: E402
from service_process import running_service  # noqa: E402

MAX_BATCH = 16


def full_size_repo(cache: Path) -> Path:
    """A repository with a random-init DeiT-S (exported once; the export needs torch)."""
    repo = cache / "repo"
    if not (repo / "deit_small_patch16_224" / "manifest.json").exists():
        from export.__main__ import main as export_main
        export_main(["deit_small_patch16_224", "--random-init", "--no-explain", "--out", str(repo)])
    return repo


def raw_images_per_s(runner: Runner, x: np.ndarray, concurrency: int, seconds: float) -> float:
    batch = np.repeat(x[None], min(concurrency, MAX_BATCH), axis=0)
    runner.run(batch)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        runner.run(batch)
        done += len(batch)
    return done / (time.perf_counter() - start)


def measure(repo: Path, model: str, levels: list[int], rounds: int, seconds: float) -> list[dict]:
    manifest = json.loads((repo / model / "manifest.json").read_text())
    buf = io.BytesIO()
    Image.fromarray(photos.chelsea()).save(buf, format="JPEG", quality=90)
    jpeg = buf.getvalue()
    x, _ = prepare(jpeg, InputPolicy.from_manifest(manifest["input"]), 10**9)
    raw = {c: [] for c in levels}
    http = {c: [] for c in levels}
    with running_service(model_repository=repo, max_batch_size=MAX_BATCH, warmup_runs=1) as url:
        runner = Runner(repo / model / "model.onnx", ["CPUExecutionProvider"], spin_wait=Settings().spin_wait)
        for _ in range(rounds):
            for c in levels:
                raw[c].append(raw_images_per_s(runner, x, c, seconds))
                level = asyncio.run(run_level(url, [("chelsea.jpg", jpeg)], c, seconds, {"model": model, "top_k": 1}))
                http[c].append(level.images_per_s)
        del runner
    return [{"model": model, "concurrency": c, "raw": statistics.median(raw[c]), "http": statistics.median(http[c])}
            for c in levels]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["shapes-deit", "deit_small_patch16_224"])
    p.add_argument("--levels", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--cache", type=Path, default=ROOT / "build" / "bench")
    args = p.parse_args()
    print(f"CPU cores: {os.cpu_count()}, max batch {MAX_BATCH}, {args.rounds} rounds of {args.seconds:g}s, "
          f"spin wait {Settings().spin_wait}")
    print(f"{'model':<24} {'clients':>7} {'raw img/s':>10} {'http img/s':>11} {'http/raw':>9}")
    for model in args.models:
        repo = ROOT / "model_repository" if (ROOT / "model_repository" / model).is_dir() else full_size_repo(args.cache)
        for row in measure(repo, model, args.levels, args.rounds, args.seconds):
            print(f"{row['model']:<24} {row['concurrency']:>7} {row['raw']:>10.1f} {row['http']:>11.1f} "
                  f"{row['http'] / row['raw']:>8.0%}", flush=True)


if __name__ == "__main__":
    main()
