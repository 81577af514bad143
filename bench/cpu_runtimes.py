"""Each CPU plan of a model beside this CPU's limit, and /classify with each plan, in one run.

    python bench/cpu_runtimes.py                                # DeiT-Ti, DeiT-S, ViT-B/16, Swin-T; batch 1 and 16
    python bench/cpu_runtimes.py --models deit_small_patch16_224 --serve deit_small_patch16_224 --clients 8 32

Graphs: `python -m export NAME --random-init --precision auto --no-explain` into --cache, once (each plan gated
against fp32 on photos and random inputs, as an export without held-out data is). For each model, plan and batch
size, the bare runner (service/engine/cpu_plans.py opens it as the service does) in interleaved rounds: images/s,
GFLOP/s (2 x the model's multiply-accumulates, models.flops, per image), and that / the measured peak of the plan's
precision: the best of a few products of two 4096 x 4096 matrices, fp32 and int8 (u8 x s8, MatMulInteger) in each
runtime and bf16 in OpenVINO. OpenVINO's own benchmark_app gives its figure for the same graph and precision
(the graph's two inputs at the same batch: it refuses different ones, so each inference is 2 x the batch).
With --serve, /classify on that model through a real server (thread backend) at each of --clients, each plan
pinned (VITSERVE_CPU_PLAN) and auto, interleaved: images/s, and the plan auto chose.
"""
import argparse
import asyncio
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from service_process import photo_bytes, running_service  # noqa: E402

from models import flops  # noqa: E402
from repository import read_entry  # noqa: E402
from service.engine.cpu_plans import CpuPlan, open_runner, verified, why_not  # noqa: E402
from service.engine.openvino_runtime import capabilities  # noqa: E402
from service.loadtest import classify_requests, run_level  # noqa: E402

MODELS = ["deit_tiny_patch16_224", "deit_small_patch16_224", "vit_base_patch16_224", "swin_tiny_patch4_window7_224"]
GEMM = 4096


def exported(name: str, cache: Path) -> Path:
    folder = cache / "cpu-plans" / name
    if not (folder / "manifest.json").exists():
        from export.__main__ import main as export_main
        export_main([name, "--random-init", "--precision", "auto", "--no-explain", "--out", str(folder.parent)])
    return folder


def gemm_graph(path: Path, int8: bool) -> Path:
    """One product of a GEMM x GEMM input with a GEMM x GEMM weight: fp32 MatMul, or u8 x s8 MatMulInteger."""
    rng = np.random.default_rng(0)
    if int8:
        weight = numpy_helper.from_array(rng.integers(-64, 64, (GEMM, GEMM), dtype=np.int8), "w")
        node, kind, out = helper.make_node("MatMulInteger", ["x", "w"], ["y"]), TensorProto.UINT8, TensorProto.INT32
    else:
        weight = numpy_helper.from_array(rng.standard_normal((GEMM, GEMM), dtype=np.float32), "w")
        node, kind, out = helper.make_node("MatMul", ["x", "w"], ["y"]), TensorProto.FLOAT, TensorProto.FLOAT
    graph = helper.make_graph([node], "gemm", [helper.make_tensor_value_info("x", kind, [GEMM, GEMM])],
                              [helper.make_tensor_value_info("y", out, [GEMM, GEMM])], [weight])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10), path)
    return path


def gemm_peaks(cache: Path, seconds: float) -> dict[str, float]:
    """GFLOP/s of the best GEMM run per runtime and precision (2 x GEMM^3 operations a run)."""
    import onnxruntime as ort
    import openvino
    fp32, int8 = gemm_graph(cache / "gemm-fp32.onnx", False), gemm_graph(cache / "gemm-int8.onnx", True)
    x32 = np.random.default_rng(1).standard_normal((GEMM, GEMM), dtype=np.float32)
    x8 = np.random.default_rng(1).integers(0, 255, (GEMM, GEMM), dtype=np.uint8)
    core = openvino.Core()
    runs = {
        "onnxruntime:fp32": (ort.InferenceSession(str(fp32), providers=["CPUExecutionProvider"]).run, x32),
        "onnxruntime:int8": (ort.InferenceSession(str(int8), providers=["CPUExecutionProvider"]).run, x8),
        **{f"openvino:{p}": (_openvino_run(core, graph, hint), x) for p, graph, hint, x in (
            ("fp32", fp32, "f32", x32), ("bf16", fp32, "bf16", x32), ("int8", int8, "f32", x8))},
    }
    peaks = {}
    for name, (run, x) in runs.items():
        best, start = math.inf, time.perf_counter()
        while time.perf_counter() - start < seconds:
            began = time.perf_counter()
            run(None, {"x": x})
            best = min(best, time.perf_counter() - began)
        peaks[name] = 2 * GEMM**3 / best / 1e9
    return peaks


def _openvino_run(core, graph: Path, hint: str):
    compiled = core.compile_model(str(graph), "CPU", {"INFERENCE_PRECISION_HINT": hint, "PERFORMANCE_HINT": "LATENCY"})
    request = compiled.create_infer_request()
    return lambda names, feeds: request.infer(feeds)


def bare(folder: Path, batches: list[int], rounds: int, seconds: float) -> dict[tuple[str, int], float]:
    """Images/s of each plan this host runs at each batch size: medians of interleaved rounds."""
    entry = read_entry(folder)
    plans = [p for p in verified(entry) if why_not(p) is None]
    runners = {p: open_runner(entry.path(p.file), ("images", "pixel_values"), p, 0, True, False) for p in plans}
    h, w = entry.policy.size
    none = np.zeros((0, 3, h, w), np.float32)
    images = {b: np.random.default_rng(b).integers(0, 256, (b, h, w, 3), dtype=np.uint8) for b in batches}
    samples = {(p.name, b): [] for p in plans for b in batches}
    for runner in runners.values():
        for b in batches:
            runner.run(images[b], none)
    for _ in range(rounds):
        for plan, runner in runners.items():
            for b in batches:
                done, start = 0, time.perf_counter()
                while time.perf_counter() - start < seconds or not done:
                    runner.run(images[b], none)
                    done += b
                samples[plan.name, b].append(done / (time.perf_counter() - start))
    return {key: statistics.median(values) for key, values in samples.items()}


def benchmark_app(folder: Path, plan: CpuPlan, batch: int, seconds: float) -> float | None:
    """Images/s OpenVINO's benchmark_app reports for the plan's graph and precision (both inputs at `batch`)."""
    size = read_entry(folder).policy.size
    shape = f"images[{batch},{size[0]},{size[1]},3],pixel_values[{batch},3,{size[0]},{size[1]}]"
    command = [str(Path(sys.executable).with_name("benchmark_app")), "-m", str(read_entry(folder).path(plan.file)),
               "-d", "CPU", "-hint", "latency", "-infer_precision", {"bf16": "bf16"}.get(plan.precision, "f32"),
               "-shape", shape, "-t", str(max(1, round(seconds)))]
    ran = subprocess.run(command, capture_output=True, text=True)
    found = re.search(r"Throughput:\s+([\d.]+) FPS", ran.stdout + ran.stderr)
    return float(found.group(1)) * 2 if found else None  # (its FPS counts one input's images)


def serve(folder: Path, plans: list[str], clients: list[int], seconds: float, rounds: int
          ) -> tuple[dict[tuple[str, int], float], str]:
    """/classify images/s with each plan pinned (and auto), interleaved over rounds; and the plan auto chose."""
    jpeg, name = photo_bytes("chelsea", "JPEG", quality=90), folder.name
    send = classify_requests([("chelsea.jpg", jpeg)], {"model": name, "top_k": 1})
    samples, chosen = {(p, c): [] for p in plans for c in clients}, ""
    for _ in range(rounds):
        for plan in plans:
            with running_service(model_repository=folder.parent, cpu_plan=plan, access_log="false",
                                 max_queue_delay_ms=5) as url:
                if plan == "auto":
                    import httpx
                    chosen = httpx.get(f"{url}/models", timeout=30).json()["models"][0]["plan"]
                for c in clients:
                    samples[plan, c].append(asyncio.run(run_level(url, send, c, seconds)).images_per_s)
    return {key: statistics.median(values) for key, values in samples.items()}, chosen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--serve", help="a model of --models to serve through /classify with each plan")
    p.add_argument("--clients", nargs="+", type=int, default=[8, 32])
    p.add_argument("--cache", type=Path, default=ROOT / "build" / "bench")
    p.add_argument("--json", type=Path, help="write the figures here too")
    args = p.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    print(f"{cpu}, {os.cpu_count()} cores; OpenVINO capabilities: {sorted(capabilities())}")
    peaks = gemm_peaks(args.cache, args.seconds)
    print(f"GEMM peak, GFLOP/s ({GEMM}^3):", ", ".join(f"{k} {v:,.0f}" for k, v in peaks.items()))
    report = {"cpu": cpu, "cores": os.cpu_count(), "peaks": peaks, "models": {}}
    print(f"{'model':30} {'plan':18} {'batch':>5} {'img/s':>8} {'GFLOP/s':>8} {'of peak':>7} {'bench_app':>9}")
    for name in args.models:
        folder = exported(name, args.cache)
        macs = flops(name)
        figures = bare(folder, args.batches, args.rounds, args.seconds)
        report["models"][name] = {}
        for (plan_name, batch), rate in sorted(figures.items()):
            plan = next(p for p in verified(read_entry(folder)) if p.name == plan_name)
            gflops = 2 * macs * rate  # (models.flops: GMACs per image)
            ceiling = benchmark_app(folder, plan, batch, args.seconds) if plan.runtime == "openvino" else None
            share = gflops / peaks[plan_name]
            report["models"][name][f"{plan_name} {batch}"] = {"images_per_s": rate, "gflops": gflops,
                                                              "of_peak": share, "benchmark_app": ceiling}
            print(f"{name:30} {plan_name:18} {batch:>5} {rate:>8.1f} {gflops:>8.0f} {share:>7.0%} "
                  f"{f'{ceiling:.1f}' if ceiling else '-':>9}")
    if args.serve:
        folder = exported(args.serve, args.cache)
        plans = [p.name for p in verified(read_entry(folder)) if why_not(p) is None] + ["auto"]
        served, chosen = serve(folder, plans, args.clients, args.seconds * 2, args.rounds)
        report["serve"] = {"model": args.serve, "auto chose": chosen,
                           **{f"{plan} {c}": rate for (plan, c), rate in served.items()}}
        print(f"/classify {args.serve}, thread backend, images/s (auto chose {chosen}):")
        for plan in plans:
            print(f"  {plan:18} " + "  ".join(f"{c} clients {served[plan, c]:7.1f}" for c in args.clients))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
