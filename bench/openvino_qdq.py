"""A static QDQ int8 graph on OpenVINO beside the CPU plans the export makes, in one interleaved run.

    python bench/openvino_qdq.py                        # DeiT-S at batch 1 and 16
    python bench/openvino_qdq.py --model vit_base_patch16_224 --batches 16

The fp32 graph: `python -m export MODEL --random-init --no-explain` into --cache, once. Beside it the export's own
dynamic int8 graph (export/precision.py quantize_int8) and a static QDQ one (bench/int8_isa.py's s8s8-qdq: s8
activations and weights, calibrated on --calibration noise images, which is enough for speed and says nothing of
accuracy). Each graph in ONNX Runtime and OpenVINO (the service's runners, engine/openvino_runtime.py: the QDQ graph
with the f32 and the bf16 hint; the fp32 one as the bf16 plan), every runner once per round in a shuffled order,
medians of --rounds: images/s and the ratio to ONNX Runtime's fp32. Last, each graph's logits against fp32's on the
calibration images: the largest difference over the logits' mean spread (the export gate's measure; no gate here).
"""
import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
from export_speed import interleaved  # noqa: E402
from int8_isa import quantize  # noqa: E402

from export.__main__ import main as export_main  # noqa: E402
from export.precision import quantize_int8  # noqa: E402
from repository import read_entry  # noqa: E402
from service.engine.openvino_runtime import OpenVinoRunner, capabilities  # noqa: E402
from service.engine.runtime import CPU, Runner  # noqa: E402

INPUTS = ("images", "pixel_values")


def graphs(model: str, cache: Path, calibration: np.ndarray) -> dict[str, Path]:
    """fp32 (exported already), the export's dynamic int8 and the static QDQ int8 graph of `model`, made once in
    `cache`."""
    fp32 = cache / model / "model.onnx"
    dynamic, qdq = cache / f"{model}.dynamic-int8.onnx", cache / f"{model}.qdq-int8.onnx"
    if not dynamic.exists():
        quantize_int8(fp32, dynamic)
    if not qdq.exists():
        quantize(fp32, "s8s8-qdq", qdq, calibration)
    return {"fp32": fp32, "dynamic int8": dynamic, "QDQ int8": qdq}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="deit_small_patch16_224")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeat", type=int, default=4, help="runs per runner per round")
    p.add_argument("--calibration", type=int, default=32, help="noise images the QDQ graph is calibrated on")
    p.add_argument("--cache", type=Path, default=Path("/tmp/openvino-qdq"))
    args = p.parse_args()
    rng = np.random.default_rng(0)
    fp32 = args.cache / args.model
    if not (fp32 / "model.onnx").exists():
        export_main([args.model, "--random-init", "--no-explain", "--out", str(args.cache)])
    h, w = read_entry(fp32).policy.size
    calibration = rng.integers(0, 256, (args.calibration, h, w, 3), np.uint8)
    paths = graphs(args.model, args.cache, calibration)
    runners = {"ORT fp32": Runner(paths["fp32"], INPUTS, [CPU]),
               "OpenVINO bf16 (fp32 graph)": OpenVinoRunner(paths["fp32"], INPUTS, "bf16"),
               "ORT dynamic int8": Runner(paths["dynamic int8"], INPUTS, [CPU]),
               "OpenVINO dynamic int8": OpenVinoRunner(paths["dynamic int8"], INPUTS, "int8"),
               "ORT QDQ int8": Runner(paths["QDQ int8"], INPUTS, [CPU]),
               "OpenVINO QDQ int8": OpenVinoRunner(paths["QDQ int8"], INPUTS, "int8"),
               "OpenVINO QDQ int8, bf16 hint": OpenVinoRunner(paths["QDQ int8"], INPUTS, "bf16")}
    print(f"{args.model}; OpenVINO says this CPU computes {', '.join(sorted(capabilities()))}")
    none = np.zeros((0, 3, h, w), np.float32)
    for batch in args.batches:
        x = rng.integers(0, 256, (batch, h, w, 3), np.uint8)
        calls = {name: (lambda r=runner, x=x: r.run(x, none)) for name, runner in runners.items()}
        seconds = interleaved(calls, args.rounds, args.repeat)
        base = seconds["ORT fp32"]
        for name, s in seconds.items():
            print(f"batch {batch:3d}  {name:30s} {batch / s:8.1f} images/s  {base / s:5.2f}x ORT fp32")
    want = runners["ORT fp32"].run(calibration, none)["logits"]
    for name, runner in list(runners.items())[1:]:
        got = runner.run(calibration, none)["logits"]
        error = np.abs(got - want).max() / np.ptp(want, axis=1).mean()
        print(f"{name:30s} logits max |diff| / mean spread {error:.4f}")


if __name__ == "__main__":
    main()
