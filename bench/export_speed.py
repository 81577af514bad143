"""Torch eager vs ONNX Runtime fp32 vs ONNX Runtime int8 on the CPU, interleaved in one run.

    python bench/export_speed.py                       # DeiT-S and Swin-T at batch 1 and 16
    python bench/export_speed.py --models deit_tiny_patch16_224 --batches 1 8 --rounds 10
    python bench/export_speed.py --profile 16          # also: where ORT fp32 and int8 spend a batch of 16
    python bench/export_speed.py --profile 64 --profile-device cuda   # GPU time by kernel of ORT fp32 and fp16
                                                       # (fp16 as exported, and without its ORT fusions; no CPU
                                                       # timing unless --batches are given)
    python bench/export_speed.py --int8-variants       # also: 8-bit, per-channel and unsigned int8 weights
    python bench/export_speed.py --conv-patch-embed    # also: the graph with the patch embedding as a Conv
    python bench/export_speed.py --fused               # also: the fp32 graph with the fp16 graph's ORT fusions
    python bench/export_speed.py --against /tmp/base-cache   # also: the fp32 graphs another checkout exported
        # (a graph change's A/B: git worktree add /tmp/base COMMIT; python /tmp/base/bench/export_speed.py
        #  --cache /tmp/base-cache --rounds 1; then this, in the changed tree)

All run the served graph (logits plus the attention outputs) from the same random weights, fed normalised
float pixels (its `pixel_values` input, what torch gets too); ONNX Runtime at
each graph optimisation level (basic: constant folding and redundancy removal; extended: also operator
fusions such as SkipLayerNorm, BiasGelu and the int8 DynamicQuantizeMatMul; all: also layout changes).
Each round times every variant once, in a shuffled order, so drift in the machine's speed hits all of them
alike; the figures are medians over rounds. Graphs are exported once into --cache.
"""
import argparse
import collections
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from export.fusion import REWRITES, fuse_for_ort  # noqa: E402
from export.graph import MainGraph, export_form, export_graph, export_program, save_graph  # noqa: E402
from export.precision import INT8_VARIANTS, INT8_WEIGHTS, convert_fp16, quantize_int8  # noqa: E402
from models import create_model  # noqa: E402
from repository import graph_inputs  # noqa: E402


def ort_session(path: Path, level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL):
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.intra_op_num_threads = os.cpu_count()
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


# int8 is what `python -m export --precision int8` writes (7-bit s8 weights per tensor); the other weight formats
# of export/precision.py's INT8_VARIANTS are only timed with --int8-variants
QUANTIZED = {"int8": INT8_VARIANTS[INT8_WEIGHTS],
             **{f"int8-{k}": v for k, v in INT8_VARIANTS.items() if k != INT8_WEIGHTS}}
LEVELS = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
          "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}


def graph_path(cache: Path, name: str, precision: str) -> Path:
    precision = f"int8-{INT8_WEIGHTS}" if precision == "int8" else precision  # a cache from older int8 is not reused
    return cache / f"{name}.uint8-input.{precision}.onnx"  # graphs with the images input (schema 2)


def variants(name: str, cache: Path, int8_variants: bool, conv_patch_embed: bool, fused: bool,
             against: Path | None) -> tuple[dict, int]:
    """The callables to compare, each taking a float32 NCHW batch, and the model's input size."""
    torch.manual_seed(0)
    main = MainGraph(create_model(name))
    fp32 = graph_path(cache, name, "fp32")
    if not fp32.exists():
        print(f"exporting {name} ...", file=sys.stderr)
        export_graph(MainGraph(export_form(main.model)), main.model.spec.img_size, fp32)  # as `python -m export`
    if conv_patch_embed and not graph_path(cache, name, "fp32-conv").exists():
        export_graph(main, main.model.spec.img_size, graph_path(cache, name, "fp32-conv"))
    if fused and not graph_path(cache, name, "fp32-fused").exists():
        graph = export_program(MainGraph(export_form(main.model)), main.model.spec.img_size)
        fuse_for_ort(graph)
        save_graph(graph, graph_path(cache, name, "fp32-fused"))
    quantized = list(QUANTIZED) if int8_variants else ["int8"]
    for precision in quantized:
        if not graph_path(cache, name, precision).exists():
            quantize_int8(fp32, graph_path(cache, name, precision), **QUANTIZED[precision])
    # fp32 and int8 at every optimisation level; the other int8 variants at the level the service uses
    sessions = {f"ort {precision} {level}": ort_session(graph_path(cache, name, precision), value)
                for precision in ("fp32", "int8") for level, value in LEVELS.items()}
    extra = quantized[1:] + (["fp32-conv"] if conv_patch_embed else []) + (["fp32-fused"] if fused else [])
    sessions.update({f"ort {precision} all": ort_session(graph_path(cache, name, precision)) for precision in extra})
    if against:
        sessions["ort fp32 against all"] = ort_session(graph_path(against, name, "fp32"))

    size = main.model.spec.img_size
    no_images = torch.zeros(0, size, size, 3, dtype=torch.uint8)

    def torch_call(x):
        with torch.inference_mode():
            return main(no_images, torch.from_numpy(x))

    calls = {"torch eager": torch_call}
    calls.update({k: (lambda s: lambda x: s.run(None, graph_inputs(x)))(s) for k, s in sessions.items()})
    return calls, size


def fp16_graph_path(cache: Path, name: str, without: tuple[str, ...] = (), batch: int | None = None) -> Path:
    """Where fp16_graph keeps that graph in `cache`."""
    left_out = "-unfused" if set(without) == set(REWRITES) else "".join(f"-without-{w}" for w in without)
    return graph_path(cache, name, "fp16" + left_out.replace(" ", "_") + (f"-static{batch}" if batch else ""))


def fp16_graph(cache: Path, name: str, without: tuple[str, ...] = (), batch: int | None = None) -> Path:
    """The fp16 graph as `python -m export --precision fp16` writes it (fused for ORT; its inputs without the
    empty defaults, which change no run), or without some of fuse_for_ort's REWRITES (all of them: "unfused");
    with `batch`, exported for that many images, every shape fixed."""
    path = fp16_graph_path(cache, name, without, batch)
    if not path.exists():
        torch.manual_seed(0)
        model = create_model(name)
        graph = export_program(MainGraph(export_form(model)), model.spec.img_size, batch)
        fuse_for_ort(graph, without)
        with tempfile.TemporaryDirectory() as tmp:
            save_graph(graph, Path(tmp) / "fp32.onnx")
            convert_fp16(Path(tmp) / "fp32.onnx", path)
    return path


def op_times(path: Path, batch: int, size: int, runs: int = 3) -> tuple[str, dict[str, float]]:
    """ORT's own profile on the CPU: the provider the session got, and milliseconds per batch spent in each
    operator type (as fused by level `all`)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count()
    options.enable_profiling = True
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((batch, 3, size, size), dtype=np.float32)
    for _ in range(1 + runs):  # the first run (allocations, kernel choice) is left out below
        session.run(None, graph_inputs(x))
    trace = Path(session.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()
    measured_from = sorted(e["ts"] for e in events if e["name"] == "model_run")[1]
    totals = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time") and event["ts"] >= measured_from:
            totals[event["args"]["op_name"]] += event["dur"] / 1e3 / runs
    return session.get_providers()[0], dict(totals.most_common())


def kernel_times(path: Path, batch: int, size: int, runs: int = 3) -> tuple[str, dict[str, float]]:
    """GPU milliseconds per batch by CUDA kernel, recorded by CUPTI through torch.profiler. Not ORT's own
    profile: on CUDA that times each node's launch on the host, which put Swin-T's masked attention at 10% of
    its fp16 time when its softmax kernel took half of the GPU's."""
    from torch.profiler import ProfilerActivity, profile
    session = ort.InferenceSession(str(path), providers=["CUDAExecutionProvider"])
    feeds = graph_inputs(np.random.default_rng(0).standard_normal((batch, 3, size, size), dtype=np.float32))
    for _ in range(2):  # allocations, kernel choice
        session.run(None, feeds)
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(runs):
            session.run(None, feeds)
    totals = collections.Counter()
    for event in trace.key_averages():
        totals[kernel_name(event.key)] += event.self_device_time_total / 1e3 / runs
    return session.get_providers()[0], {k: v for k, v in totals.most_common() if v > 0}


def kernel_name(signature: str) -> str:
    """'void onnxruntime::cuda::_GatherKernel<short>(long, ...)' -> '_GatherKernel'."""
    return signature.removeprefix("void ").split("<")[0].split("(")[0].split("::")[-1][:48].strip()


def print_profile(name: str, cache: Path, batch: int, size: int, device: str) -> None:
    if device == "cuda":
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            print(f"\n{name}: no CUDA profile, the CUDA provider is not in this onnxruntime")
            return
        graphs = {"fp32": graph_path(cache, name, "fp32"), "fp16 unfused": fp16_graph(cache, name, tuple(REWRITES)),
                  "fp16": fp16_graph(cache, name)}
        profiles = {p: kernel_times(path, batch, size) for p, path in graphs.items()}
        print(f"\n{name}, batch {batch}: GPU ms per batch by kernel (CUPTI, 3 runs, the float input copied in)")
    else:
        profiles = {p: op_times(graph_path(cache, name, p), batch, size) for p in ("fp32", "int8")}
        print(f"\n{name}, batch {batch}: ms per batch by operator type (ORT's profile of 3 runs)")
    for precision, (used, times) in profiles.items():
        total = sum(times.values())
        top = ", ".join(f"{op} {ms:.1f} ({ms / total:.0%})" for op, ms in list(times.items())[:8])
        print(f"  {precision} on {used}: total {total:.1f}: {top}")


def interleaved(calls: dict[str, Callable[[], object]], rounds: int, repeat: int) -> dict[str, float]:
    """Median seconds per call of each variant, after one warm-up call each (first-run allocations, kernel
    selection), interleaved round by round in a shuffled order."""
    for call in calls.values():
        call()
    times = {k: [] for k in calls}
    for _ in range(rounds):
        order = list(calls)
        random.shuffle(order)
        for k in order:
            start = time.perf_counter()
            for _ in range(repeat):
                calls[k]()
            times[k].append((time.perf_counter() - start) / repeat)
    return {k: statistics.median(v) for k, v in times.items()}


def bench(calls: dict, batch: int, size: int, rounds: int, repeat: int) -> dict[str, float]:
    """Median seconds per call of each variant on one random float batch."""
    x = torch.randn(batch, 3, size, size).numpy()
    return interleaved({k: partial(call, x) for k, call in calls.items()}, rounds, repeat)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["deit_small_patch16_224", "swin_tiny_patch4_window7_224"])
    p.add_argument("--batches", nargs="*", type=int,
                   help="batch sizes of the CPU timing (default 1 16; none with --profile-device cuda, where the "
                        "CPU's figures are not what is asked for)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--cache", type=Path, default=Path("build/bench"))
    p.add_argument("--profile", type=int, metavar="BATCH",
                   help="also print where ORT spends a batch of BATCH: by operator type on the CPU, by kernel on CUDA")
    p.add_argument("--profile-device", choices=["cpu", "cuda"], default="cpu",
                   help="profile fp32 and int8 on the CPU, or fp32 and fp16 on CUDA (GPU kernel times through "
                        "torch.profiler; a session that cannot start on CUDA falls back to the CPU: check the "
                        "provider line)")
    p.add_argument("--int8-variants", action="store_true",
                   help="also time the other int8 weight formats (export/precision.py INT8_VARIANTS; their "
                        "agreement on both x86 instruction sets: bench/int8_isa.py)")
    p.add_argument("--conv-patch-embed", action="store_true",
                   help="also time the fp32 graph with its patch embedding as a strided Conv (before the MatMul)")
    p.add_argument("--fused", action="store_true",
                   help="also time the fp32 graph with fuse_for_ort's rewrites (the fp16 graph's, before conversion)")
    p.add_argument("--against", type=Path, metavar="CACHE",
                   help="also time the fp32 graphs in another --cache (exported by another checkout)")
    args = p.parse_args()
    if args.batches is None:
        args.batches = [] if args.profile_device == "cuda" else [1, 16]
    args.cache.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(os.cpu_count())
    print(f"CPU threads: {os.cpu_count()}, torch {torch.__version__}, onnxruntime {ort.__version__}")
    header = (f"{'model':<30} {'batch':>5} {'variant':<34} {'ms/batch':>9} {'img/s':>7} {'vs torch':>9} "
              f"{'int8 vs fp32':>12}")
    if args.batches:
        print(header)
        print("-" * len(header))
    for name in args.models:
        calls, size = variants(name, args.cache, args.int8_variants, args.conv_patch_embed, args.fused,
                                  args.against)
        for batch in args.batches:
            med = bench(calls, batch, size, args.rounds, repeat=4 if batch == 1 else 1)
            for k, t in med.items():
                vs_fp32 = f"{med['ort fp32 ' + k.split()[-1]] / t:>11.2f}x" if "int8" in k else ""
                print(f"{name:<30} {batch:>5} {k:<34} {t * 1e3:>9.1f} {batch / t:>7.1f} "
                      f"{med['torch eager'] / t:>8.2f}x {vs_fp32}")
        if args.profile:
            print_profile(name, args.cache, args.profile, size, args.profile_device)


if __name__ == "__main__":
    main()
