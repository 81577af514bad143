"""What the HTTP service costs on top of the bare ONNX Runtime session, per backend, in images/sec and CPU.

    python bench/service_overhead.py                 # the null graph, the embedded default model, a full-size DeiT-S
    python bench/service_overhead.py --models shapes-deit --backends thread process --seconds 5 --rounds 3

null:        a graph with shapes-deit's inputs and outputs that computes next to nothing: the service's own CPU
             per image, with no inference to share the cores with.

raw(c):      one session (the server's thread settings) on batches of min(c, max batch size) uint8 images: what
             a server with zero overhead would reach with c clients, and its CPU ms per image.
v2(c):       c clients, each request one preprocessed image as an FP32 binary tensor (KServe v2, tritonclient's
             encoding), logits back as binary: HTTP and batching, no image decoding.
classify(c): c clients, each request one JPEG photo (chelsea, 451 x 300) to POST /classify: decoding and the
             multipart upload on top.
x8(c):       the same photo, 8 per request, from c / 8 clients (at least one): the same images in flight, an
             eighth of the requests.
Per backend (`python -m service --backend thread|process`), all services running side by side, raw and HTTP
measurements alternating round by round; figures are medians over rounds. The clients run on the same machine.
CPU ms/img: the service's CPU time (process_cpu_seconds_total, all its processes) per image it ran; "beyond"
subtracts the raw session's CPU per image, and for /classify also what decoding and resizing that JPEG costs one
thread here (the service's own upload_input, timed in this process, round by round). Service settings come
from the environment as usual.
"""
import argparse
import asyncio
import contextlib
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from service_process import metric, model_pixels, photo_bytes, process_metrics, running_service  # noqa: E402

from repository import InputPolicy, sha256  # noqa: E402
from service.images.decode import upload_input  # noqa: E402
from service.loadtest import Send, classify_requests, run_level, v2_requests  # noqa: E402
from service.engine.runtime import CPU, Runner  # noqa: E402
from service.core.settings import Settings  # noqa: E402

MAX_BATCH = 16


def null_repo(cache: Path) -> Path:
    """A repository with `null`: shapes-deit's interface (inputs, outputs, manifest) over a graph that reads one
    value of each image, so the service's CPU per image is its own (the graph's cost per image is a few copies of
    its outputs)."""
    from onnx import TensorProto, helper, save_model

    repo = cache / "null-repo"
    (repo / "null").mkdir(parents=True, exist_ok=True)
    manifest = json.loads((ROOT / "model_repository" / "shapes-deit" / "manifest.json").read_text())
    consts = {"zeros": [0, 0, 0, 0], "axes": [1, 2, 3], "one": [1], "two": [2],
              "big": [2**62, 1, 1, 1], "logits_shape": [1, 6], "attention_shape": [1, 4, 144]}
    node = helper.make_node
    nodes = [node("Slice", ["images", "zeros", "big"], ["pixel"]),  # images[:, :1, :1, :1]
             node("Cast", ["pixel"], ["pixels"], to=TensorProto.FLOAT),
             node("Squeeze", ["pixels", "axes"], ["m1"]),
             node("Slice", ["pixel_values", "zeros", "big"], ["value"]),
             node("Squeeze", ["value", "axes"], ["m2"]),
             node("Concat", ["m1", "m2"], ["m"], axis=0), node("Unsqueeze", ["m", "one"], ["m_1"]),
             node("Expand", ["m_1", "logits_shape"], ["logits"]), node("Unsqueeze", ["m_1", "two"], ["m_2"]),
             node("Expand", ["m_2", "attention_shape"], ["cls_attention"]),
             node("Expand", ["m_2", "attention_shape"], ["dist_attention"])]
    tensor = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes, "null", [tensor("images", TensorProto.UINT8, ["b1", 96, 96, 3]),
                        tensor("pixel_values", TensorProto.FLOAT, ["b2", 3, 96, 96])],
        [tensor("logits", TensorProto.FLOAT, ["b", 6]), tensor("cls_attention", TensorProto.FLOAT, ["b", 4, 144]),
         tensor("dist_attention", TensorProto.FLOAT, ["b", 4, 144])],
        [helper.make_tensor(k, TensorProto.INT64, [len(v)], v) for k, v in consts.items()])
    save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)], ir_version=10),
               repo / "null" / "model.onnx")
    manifest["attention"].pop("explain_outputs", None)
    graph_file = repo / "null" / "model.onnx"
    manifest |= {"name": "null", "files": {"model": {"path": "model.onnx", "sha256": sha256(graph_file),
                                                     "bytes": graph_file.stat().st_size}}}
    (repo / "null" / "manifest.json").write_text(json.dumps(manifest))
    return repo


def full_size_repo(cache: Path) -> Path:
    """A repository with a random-init DeiT-S (exported once; the export needs torch)."""
    repo = cache / "repo"
    if not (repo / "deit_small_patch16_224" / "manifest.json").exists():
        from export.__main__ import main as export_main
        export_main(["deit_small_patch16_224", "--random-init", "--no-explain", "--out", str(repo)])
    return repo


def raw_figures(runner: Runner, pixels: np.ndarray, concurrency: int, seconds: float) -> tuple[float, float]:
    """(images/s, CPU ms per image) of the bare session on batches of min(concurrency, MAX_BATCH) images."""
    batch = np.repeat(pixels[None], min(concurrency, MAX_BATCH), axis=0)
    no_tensors = np.zeros((0, 3, *pixels.shape[:2]), np.float32)
    runner.run(batch, no_tensors)
    done, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        runner.run(batch, no_tensors)
        done += len(batch)
    return done / (time.perf_counter() - start), (time.process_time() - cpu) / done * 1e3


def decode_cpu_ms(jpeg: bytes, policy: InputPolicy, repeats: int = 50) -> float:
    """CPU ms to decode and resize the JPEG as the service does, on one thread."""
    start = time.process_time()
    for _ in range(repeats):
        upload_input(jpeg, policy, 10**9)
    return (time.process_time() - start) / repeats * 1e3


def counters(url: str, model: str) -> np.ndarray:
    """(service CPU s, this process's CPU s, images run through `model`)."""
    text = httpx.get(f"{url}/metrics").text
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return np.array([process_metrics(text)["process_cpu_seconds_total"], usage.ru_utime + usage.ru_stime,
                     metric(text, "vitserve_images_total", model=model)])


def http_level(url: str, model: str, send: Send, concurrency: int, seconds: float, files: int = 1) -> dict:
    before = counters(url, model)
    images_per_s = asyncio.run(run_level(url, send, concurrency, seconds, files_per_request=files)).images_per_s
    server, client, images = counters(url, model) - before
    return {"images_per_s": images_per_s, "server_ms": server / images * 1e3, "client_ms": client / images * 1e3}


def measure(repo: Path, model: str, backends: list[str], levels: list[int], rounds: int, seconds: float) -> list[dict]:
    manifest = json.loads((repo / model / "manifest.json").read_text())
    jpeg = photo_bytes("chelsea", "JPEG", quality=90)
    pixels, policy = model_pixels(repo / model, jpeg), InputPolicy.from_manifest(manifest["input"])
    photo, params = [("chelsea.jpg", jpeg)], {"model": model, "top_k": 1}
    routes = {"v2": (v2_requests(model, manifest["tensor_input"]["name"], policy.normalise(pixels[None])), 1),
              "classify": (classify_requests(photo, params), 1), "x8": (classify_requests(photo, params, 8), 8)}
    rows = {(b, c): {} for b in backends for c in levels}
    with contextlib.ExitStack() as stack:
        urls = {b: stack.enter_context(running_service(model_repository=repo, max_batch_size=MAX_BATCH, warmup_runs=1,
                                                       backend=b, workers=2)) for b in backends}
        runner = Runner(repo / model / "model.onnx", ("images", "pixel_values"), [CPU],
                        spin_wait=Settings().spin_wait)
        for _ in range(rounds):
            for c in levels:
                raw_per_s, raw_ms = raw_figures(runner, pixels, c, seconds)
                for b in backends:
                    figures = {"raw": raw_per_s, "raw_ms": raw_ms, "decode_ms": decode_cpu_ms(jpeg, policy)}
                    for route, (send, files) in routes.items():
                        clients = max(1, c // files)
                        for k, v in http_level(urls[b], model, send, clients, seconds, files).items():
                            figures[f"{route}_{k}"] = v
                    for k, v in figures.items():
                        rows[b, c].setdefault(k, []).append(v)
    return [{"model": model, "backend": b, "concurrency": c, **{k: statistics.median(v) for k, v in f.items()}}
            for (b, c), f in rows.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["null", "shapes-deit", "deit_small_patch16_224"])
    p.add_argument("--backends", nargs="+", default=["thread", "process"], choices=["thread", "process"])
    p.add_argument("--levels", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--repository", type=Path, default=ROOT / "model_repository",
                   help="where the models are (a full-size DeiT-S is exported into --cache when asked for)")
    p.add_argument("--cache", type=Path, default=ROOT / "build" / "bench")
    args = p.parse_args()
    print(f"CPU cores: {os.cpu_count()}, max batch {MAX_BATCH}, {args.rounds} rounds of {args.seconds:g}s, "
          f"process backend with 2 HTTP workers")
    print(f"{'model':<22} {'backend':<8} {'clients':>7} {'raw img/s':>9} {'v2 img/s':>14} {'classify img/s':>15} "
          f"{'x8 img/s':>15} | CPU ms/img: {'raw':>5} {'v2':>5} {'beyond':>6} {'classify':>8} {'decode':>6} "
          f"{'beyond':>6} {'x8':>5} {'client':>6}")
    for model in args.models:
        repo = (null_repo(args.cache) if model == "null" else args.repository if (args.repository / model).is_dir()
                else full_size_repo(args.cache))
        for r in measure(repo, model, args.backends, args.levels, args.rounds, args.seconds):
            print(f"{r['model']:<22} {r['backend']:<8} {r['concurrency']:>7} {r['raw']:>9.1f} "
                  f"{r['v2_images_per_s']:>7.1f} ({r['v2_images_per_s'] / r['raw']:>4.0%}) "
                  f"{r['classify_images_per_s']:>8.1f} ({r['classify_images_per_s'] / r['raw']:>4.0%}) "
                  f"{r['x8_images_per_s']:>8.1f} ({r['x8_images_per_s'] / r['raw']:>4.0%}) | "
                  f"{'':>11} {r['raw_ms']:>5.2f} {r['v2_server_ms']:>5.2f} {r['v2_server_ms'] - r['raw_ms']:>6.2f} "
                  f"{r['classify_server_ms']:>8.2f} {r['decode_ms']:>6.2f} "
                  f"{r['classify_server_ms'] - r['raw_ms'] - r['decode_ms']:>6.2f} {r['x8_server_ms']:>5.2f} "
                  f"{r['classify_client_ms']:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
