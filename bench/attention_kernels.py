"""Which attention kernel ONNX Runtime's CUDA provider picks for each attention node of the fp16 graphs.

    python bench/attention_kernels.py
    python bench/attention_kernels.py --models swin_tiny_patch4_window7_224 \
        --without "window attention as MultiHeadAttention"

ORT falls back quietly (to its unfused kernel: scores written out) when no fused kernel takes a node's shapes
or attention bias, and `bench/gpu.py --sdpa-kernels` forces a kernel that may then not be the one that ran. With
ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO=1, which this script sets, com.microsoft MultiHeadAttention and Attention
print the kernel they chose (`SdpaKernel=...`; ONNX's own opset-23 Attention prints nothing); this counts those
lines per model and operator, over one run. The fp16 graphs are exported once, random-init, into --cache
(bench/export_speed.py's fp16_graph).
"""
import argparse
import collections
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

os.environ["ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO"] = "1"  # read when a session builds its kernels
import onnxruntime as ort  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.export_speed import fp16_graph  # noqa: E402
from export.fusion import REWRITES  # noqa: E402
from repository import graph_inputs  # noqa: E402
from service.engine.runtime import CUDA  # noqa: E402


def printed_by(call) -> str:
    """What `call` writes to the process's stdout, C++ included (the kernels print with printf/std::cout)."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 1)
        try:
            call()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        return captured.read().decode(errors="replace")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["deit_tiny_patch16_224", "swin_tiny_patch4_window7_224"])
    p.add_argument("--without", nargs="*", default=[], choices=list(REWRITES), metavar="REWRITE",
                   help="the fp16 graph without these of export/fusion.py's rewrites")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--cache", type=Path, default=ROOT / "build" / "bench")
    args = p.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    print(f"onnxruntime {ort.__version__}, batch {args.batch}" + (f", without {args.without}" if args.without else ""))
    for model in args.models:
        session = ort.InferenceSession(str(fp16_graph(args.cache, model, tuple(args.without))), providers=[CUDA])
        size = session.get_inputs()[0].shape[1]
        feeds = graph_inputs(np.zeros((args.batch, 3, size, size), np.float32))
        text = printed_by(lambda: session.run(None, feeds))
        # "Operator=MultiHeadAttention Node=... DataType=fp16 SdpaKernel=EFFICIENT_ATTENTION" (older ORT: "... DataType=
        # fp16 EFFICIENT_ATTENTION=1"), in terminal colours
        kernels = collections.Counter(f"{op}: {kernel.strip()}" for op, kernel in re.findall(
            r"Operator=(\w+).*?DataType=\w+ ([^\x1b\n]*)", text))
        found = "; ".join(f"{k} x{n}" for k, n in kernels.most_common()) or "none printed"
        print(f"{model} on {session.get_providers()[0]}: {found}", flush=True)


if __name__ == "__main__":
    main()
