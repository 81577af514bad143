"""What the HTTP service costs on top of the bare ONNX Runtime session, in images/sec.

    python bench/service_overhead.py                 # the embedded default model and a full-size DeiT-S
    python bench/service_overhead.py --models shapes-deit --seconds 5 --rounds 3

raw(c):      one session (the server's thread settings) on batches of min(c, max batch size) preprocessed
             images: what a server with zero overhead would reach with c clients.
v2(c):       c clients, each request one preprocessed image as a binary tensor (KServe v2, tritonclient's
             encoding) to a real `python -m service`: HTTP and batching, no image decoding.
classify(c): c clients, each request one JPEG photo (chelsea, 451 x 300) to POST /classify: decoding,
             preprocessing and the multipart upload on top.
The clients run on the same machine as the server. CPU ms/img is the server's CPU time (its
process_cpu_seconds_total metric) and the client's, per image the server ran, during the /classify level.
Raw and HTTP measurements alternate, round by round; the figures are medians over rounds. Service settings
come from the environment as usual (e.g. VITSERVE_SPIN_WAIT=true), and the raw session follows them.
"""
import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from service.loadtest import Send, classify_requests, run_level  # noqa: E402
from service.preprocess import InputPolicy, prepare  # noqa: E402
from service.routers.kserve import HEADER_LENGTH  # noqa: E402
from service.runtime import Runner  # noqa: E402
from service.settings import Settings  # noqa: E402
from service_process import metric, photo_bytes, process_metrics, running_service  # noqa: E402

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


def v2_requests(model: str, x: np.ndarray) -> Send:
    """POST /v2/models/MODEL/infer with one [1, 3, H, W] FP32 image as a binary tensor, logits back as JSON."""
    blob = np.ascontiguousarray(x[None], dtype="<f4").tobytes()
    header = json.dumps({"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1, *x.shape],
                                     "parameters": {"binary_data_size": len(blob)}}],
                         "outputs": [{"name": "logits"}]}).encode()
    body, headers = header + blob, {HEADER_LENGTH: str(len(header)), "Content-Type": "application/octet-stream"}

    async def send(session: aiohttp.ClientSession, i: int) -> int:
        async with session.post(f"/v2/models/{model}/infer", data=body, headers=headers) as r:
            await r.read()
            return r.status

    return send


def cpu_and_images(url: str, model: str) -> tuple[float, float, float]:
    """(server CPU seconds, this process's CPU seconds, images the server has run through `model`)."""
    text = httpx.get(f"{url}/metrics").text
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (process_metrics(text)["process_cpu_seconds_total"], usage.ru_utime + usage.ru_stime,
            metric(text, "vitserve_images_total", model=model))


def measure(repo: Path, model: str, levels: list[int], rounds: int, seconds: float) -> list[dict]:
    manifest = json.loads((repo / model / "manifest.json").read_text())
    jpeg = photo_bytes("chelsea", "JPEG", quality=90)
    x, _ = prepare(jpeg, InputPolicy.from_manifest(manifest["input"]), 10**9)
    figures = {c: {k: [] for k in ("raw", "v2", "classify", "server_ms", "client_ms")} for c in levels}
    classify, v2 = classify_requests([("chelsea.jpg", jpeg)], {"model": model, "top_k": 1}), v2_requests(model, x)
    with running_service(model_repository=repo, max_batch_size=MAX_BATCH, warmup_runs=1) as url:
        runner = Runner(repo / model / "model.onnx", ["CPUExecutionProvider"], spin_wait=Settings().spin_wait)
        for _ in range(rounds):
            for c in levels:
                f = figures[c]
                f["raw"].append(raw_images_per_s(runner, x, c, seconds))
                f["v2"].append(asyncio.run(run_level(url, v2, c, seconds)).images_per_s)
                before = cpu_and_images(url, model)
                f["classify"].append(asyncio.run(run_level(url, classify, c, seconds)).images_per_s)
                server, client, images = (b - a for a, b in zip(before, cpu_and_images(url, model)))
                f["server_ms"].append(server / images * 1e3)
                f["client_ms"].append(client / images * 1e3)
        del runner
    return [{"model": model, "concurrency": c, **{k: statistics.median(v) for k, v in figures[c].items()}}
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
    print(f"{'model':<24} {'clients':>7} {'raw img/s':>10} {'v2 img/s':>14} {'classify img/s':>16} "
          f"{'CPU ms/img: server':>19} {'client':>7}")
    for model in args.models:
        repo = ROOT / "model_repository" if (ROOT / "model_repository" / model).is_dir() else full_size_repo(args.cache)
        for r in measure(repo, model, args.levels, args.rounds, args.seconds):
            print(f"{r['model']:<24} {r['concurrency']:>7} {r['raw']:>10.1f} "
                  f"{r['v2']:>7.1f} ({r['v2'] / r['raw']:>4.0%}) "
                  f"{r['classify']:>8.1f} ({r['classify'] / r['raw']:>4.0%}) {r['server_ms']:>19.2f} "
                  f"{r['client_ms']:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
