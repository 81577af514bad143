"""Graphs carried to a GPU host without their weights, and given new ones there.

A call to a lent GPU host carries at most 64 MiB beside the project's tree, and that host cannot export (its torch
is not the pinned one). The benchmarks' graphs have random-init weights, and a GPU kernel's speed does not depend on
the values it multiplies, so each large weight travels as its mean and standard deviation alone, and the GPU host
draws new values from a normal distribution with both. DeiT-Ti's three graphs shrink from 47 MB to 0.2, and
ViT-B/16's and Swin-T's (about 1 GB) fit at all.

    python bench/gpu_check.py --export-cache DIR   # strips DIR's graphs once they are exported (again, if refilled)
    python bench/gpu_check.py --cache DIR          # refills them before any part runs (so does bench/gpu.py)

What is kept verbatim: every tensor that is small, not floating point, not finite, or of few distinct values (Swin's
attention masks), and the graph itself.
"""
import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from repository import sha256

SIDECAR = ".weights.json"  # beside a stripped graph: what its emptied tensors held
MIN_ELEMENTS = 1 << 14  # below this a tensor costs more as text than as data
MIN_DISTINCT = 1024  # in its first 65,536 values: a weight has thousands, a mask or a table a few
FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16)


def weight_stats(tensor: TensorProto) -> tuple[float, float] | None:
    """The tensor's mean and standard deviation where it is a weight that noise of those can stand for."""
    if tensor.data_type not in FLOATS or int(np.prod(tensor.dims)) < MIN_ELEMENTS:
        return None
    values = numpy_helper.to_array(tensor).astype(np.float64)
    if not np.isfinite(values).all() or np.unique(values.ravel()[:1 << 16]).size < MIN_DISTINCT:
        return None
    return float(values.mean()), float(values.std())


def strip(graph: Path) -> None:
    """The graph rewritten without its weights' data, their statistics written beside it (SIDECAR)."""
    model = onnx.load(graph)
    stats = {}
    for tensor in model.graph.initializer:
        if found := weight_stats(tensor):
            stats[tensor.name] = found
            tensor.ClearField("raw_data")
            for field in ("float_data", "int32_data"):  # where fp32 / fp16 values sit when not raw
                tensor.ClearField(field)
    graph.with_name(graph.name + SIDECAR).write_text(json.dumps(stats))  # first: a graph is never left emptied alone
    onnx.save(model, graph)


def refill(graph: Path) -> None:
    """A stripped graph given new weights (normal, each tensor's mean and deviation), its sidecar removed; where it
    is a repository folder's graph, the manifest's sha256 and size follow."""
    sidecar = graph.with_name(graph.name + SIDECAR)
    stats, model, rng = json.loads(sidecar.read_text()), onnx.load(graph), np.random.default_rng(0)
    for tensor in model.graph.initializer:
        if tensor.name in stats:
            mean, std = stats[tensor.name]
            values = rng.standard_normal(tuple(tensor.dims), dtype=np.float32) * std + mean
            tensor.raw_data = values.astype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).tobytes()
    onnx.save(model, graph)
    manifest_path = graph.parent / "manifest.json"
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        for file in manifest["files"].values():
            if file["path"] == graph.name:
                file.update(sha256=sha256(graph), bytes=graph.stat().st_size)
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    sidecar.unlink()


def strip_all(cache: Path) -> None:
    """Every graph in the cache not stripped yet."""
    for graph in sorted(cache.rglob("*.onnx")):
        if not graph.with_name(graph.name + SIDECAR).exists():
            strip(graph)


def refill_all(cache: Path) -> list[Path]:
    """Every stripped graph in the cache refilled; the graphs it refilled."""
    graphs = [p.with_name(p.name.removesuffix(SIDECAR)) for p in sorted(cache.rglob("*" + SIDECAR))]
    for graph in graphs:
        refill(graph)
    return graphs
