"""Where a graph's time goes, by ONNX Runtime's own profiler: its nodes' kernel times summed by op type, and the
nodes that take the most, at one batch size, on CUDA or the CPU (issue 77: Swin-T in fp16 at batch 256 against
torch.compile; which of its window copies, transposes and unfused bias + softmax the export could fold).

    python bench/op_profile.py FOLDER [--batch 256] [--runs 5] [--cuda]

FOLDER is a repository folder (its manifest's input; the graph's weights may be random, bench/weightless.py).
onnxruntime-gpu's wheels are built without CUPTI's kernel events (a build option, off by default:
https://github.com/microsoft/onnxruntime/pull/9875), so on CUDA a node's recorded time would be its launch alone:
this process launches its kernels blocking (CUDA_LAUNCH_BLOCKING=1, set before CUDA starts), which makes each node's
time its kernels' plus one launch; the profiled run's wall time is printed beside their sum.
"""
import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KERNEL = "_kernel_time"  # a node's event: "<node name>_kernel_time", its op type in args.op_name


def profiled_runs(events: list[dict], runs: int) -> tuple[list[dict], list[float]]:
    """The node events inside the last `runs` model_run events (the warm-up's left out), and those runs' wall
    times in ms."""
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[-runs:]
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith(KERNEL)
             and any(start <= e["ts"] <= end for start, end in windows)]
    return nodes, [(end - start) / 1e3 for start, end in windows]


def summed(nodes: list[dict], runs: int, key: Callable[[dict], tuple]) -> list[tuple[tuple, int, float]]:
    """(key, nodes of it in one run, ms per run) for each key of the nodes, the costliest first."""
    ms, count = defaultdict(float), defaultdict(int)
    for e in nodes:
        ms[key(e)] += e["dur"] / 1e3 / runs
        count[key(e)] += 1
    return sorted(((k, count[k] // runs, ms[k]) for k in ms), key=lambda row: -row[2])


def by_op_type(nodes: list[dict], runs: int) -> list[tuple[tuple[str, str], int, float]]:
    """((op type, where it ran), nodes of it in one run, ms per run): a node the CUDA provider cannot run falls back
    to the CPU, with copies either side."""
    return summed(nodes, runs, lambda e: (e["args"]["op_name"],
                                          e["args"].get("provider", "?").removesuffix("ExecutionProvider")))


def by_node(nodes: list[dict], runs: int) -> list[tuple[tuple[str, str], int, float]]:
    """((node, op type), 1, ms per run)."""
    return summed(nodes, runs, lambda e: (e["name"].removesuffix(KERNEL), e["args"]["op_name"]))


def profile(folder: Path, batch: int, runs: int, cuda: bool) -> list[dict]:
    """The profiler's events of 2 warm-up runs and `runs` more, each on `batch` random images."""
    import onnxruntime as ort

    from repository import read_entry

    entry = read_entry(folder)
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "ort")
    providers = [("CUDAExecutionProvider", {"use_tf32": "0"})] if cuda else ["CPUExecutionProvider"]
    session = ort.InferenceSession(str(entry.path()), options, providers=providers)
    if cuda and session.get_providers()[0] != "CUDAExecutionProvider":
        sys.exit(f"the CUDA provider does not start here: {session.get_providers()}")
    h, w = entry.policy.size
    feed = {entry.manifest["input"]["name"]: np.random.default_rng(0).integers(0, 256, (batch, h, w, 3), np.uint8)}
    if "tensor_input" in entry.manifest:
        feed[entry.manifest["tensor_input"]["name"]] = np.zeros((0, 3, h, w), np.float32)
    for _ in range(2 + runs):
        session.run(None, feed)
    path = Path(session.end_profiling())
    events = json.loads(path.read_text())
    path.unlink()
    return events


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="a repository folder: its manifest and graph")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--runs", type=int, default=5, help="profiled, after 2 warm-up runs")
    p.add_argument("--cuda", action="store_true", help="on the CUDA provider, its kernels launched blocking")
    p.add_argument("--top", type=int, default=12, help="the costliest nodes listed")
    args = p.parse_args()
    if args.cuda:
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"  # before ONNX Runtime starts CUDA
    nodes, walls = profiled_runs(profile(args.folder, args.batch, args.runs, args.cuda), args.runs)
    total = sum(e["dur"] for e in nodes) / 1e3 / args.runs
    print(f"{args.folder.name} at batch {args.batch} on {'CUDA (launches blocking)' if args.cuda else 'the CPU'}: "
          f"{total:.2f} ms of node time a run over {len(nodes) // args.runs} nodes; a profiled run's wall time "
          f"{np.median(walls):.2f} ms (median of {len(walls)})")
    print("by op type: op (provider), nodes, ms a run, share")
    for (op, where), count, ms in by_op_type(nodes, args.runs):
        print(f"  {f'{op} ({where})':<36} {count:>4} {ms:>9.3f} {ms / total:>6.1%}")
    print(f"the {args.top} costliest nodes: node, op, ms a run, share")
    for (name, op), _, ms in by_node(nodes, args.runs)[:args.top]:
        print(f"  {name[:60]:<60} {op:<24} {ms:>8.3f} {ms / total:>6.1%}")


if __name__ == "__main__":
    main()
