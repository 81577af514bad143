"""int8 weight formats on the two x86 instruction sets ONNX Runtime's int8 GEMMs differ on: the export's int8 gate
(top-1 agreement and logit error against the fp32 graph) natively and under qemu-user as an AVX2 CPU without
VNNI, and the speed natively, interleaved.

    python bench/int8_isa.py                                  # every variant, both cases, natively and under qemu
    python bench/int8_isa.py --cases ci --variants u8s8 u8s8-7bit --rounds 0     # agreement only
    python bench/int8_isa.py --no-qemu                        # this CPU only

Why: on an AVX2 CPU without VNNI, ONNX Runtime's u8×s8 GEMM adds each pair of products into a saturating int16
(export/isa.py). A CI host of that kind failed tests/test_export.py's int8 gate (top-1 agreement 0.542, logit
error 43.6%) that passes on AVX-512 VNNI. `qemu-x86_64 -cpu Haswell` (apt-get install qemu-user) runs the same
Python and ONNX Runtime as that CPU; the script first checks that MLAS saturates there (and not here).

Cases:
  ci          vit_micro_patch8_96 from torch.manual_seed(0) random weights and 24 synthetic held-out images:
              tests/test_export.py's int8 gate, every image under qemu too.
  shapes-vit  the demo weights (model_repository/shapes-vit/model.onnx, `make models`) on data/shapes/val: the
              embedded shapes-vit-int8's gate; under qemu every k-th image (--qemu-images, about 0.3 s each).
Variants (export/precision.py INT8_VARIANTS): dynamic quantization of MatMul/Gemm with u8 activations and
  u8s8         s8 weights per tensor (the export before 2026-11-27);  u8s8-7bit  the same, weights in [-64, 64]
  (reduce_range); u8s8-per-channel, u8s8-per-channel-7bit  one scale per output column; u8u8  u8 weights;
  and s8s8-qdq  static QDQ, s8 activations and weights, calibrated on 64 of the held-out images (which flatters it).
The reference is the fp32 graph run here, for the emulated runs too (fp32 under qemu differs by 2.5e-7 on ci).
Speed: every variant and fp32 once per round in a shuffled order at each batch size, medians, graph level all,
as many threads as cores.
"""
import argparse
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from export import isa  # noqa: E402
from export.precision import INT8_OP_TYPES, INT8_VARIANTS, quantize_int8  # noqa: E402
from repository import graph_inputs  # noqa: E402

VARIANTS = [*INT8_VARIANTS, "s8s8-qdq"]
MODEL = "vit_micro_patch8_96"


def ci_case(cache: Path) -> tuple[Path, np.ndarray]:
    """tests/test_export.py's int8 gate: its random-init ViT exported as fp32, and its 24 held-out images."""
    import torch
    from safetensors.torch import save_file

    import models
    from export.__main__ import main as export_main
    from models.synthetic import __main__ as synthetic
    folder = cache / "ci"
    if not (folder / "vit" / "model.onnx").exists():
        folder.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)  # the test's repo fixture: the ViT is the first model it draws
        save_file(models.create_model(MODEL).state_dict(), folder / "vit.safetensors")
        synthetic.main(["shapes", "--out", str(folder / "data"), "--train", "0", "--val", "24", "--workers", "1"])
        export_main([MODEL, "--weights", str(folder / "vit.safetensors"), "--name", "vit", "--out", str(folder),
                     "--no-explain"])
    return folder / "vit" / "model.onnx", heldout(folder / "data" / "val")


def heldout(folder: Path) -> np.ndarray:
    """The gate's held-out images as uint8 NHWC, preprocessed as the export does."""
    from export.parity import gate_inputs
    from models import get_spec
    return gate_inputs(get_spec(MODEL), folder).heldout.numpy()


def quantize(fp32: Path, variant: str, dst: Path, calibration: np.ndarray) -> Path:
    if variant in INT8_VARIANTS:
        quantize_int8(fp32, dst, **INT8_VARIANTS[variant])
        return dst
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([graph_inputs(calibration[i:i + 8]) for i in range(0, len(calibration), 8)])

        def get_next(self):
            return next(self.batches, None)

    with tempfile.TemporaryDirectory() as tmp:
        quant_pre_process(str(fp32), str(Path(tmp) / "prepared.onnx"), skip_symbolic_shape=True)
        quantize_static(Path(tmp) / "prepared.onnx", dst, Reader(), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=INT8_OP_TYPES, activation_type=QuantType.QInt8,
                        weight_type=QuantType.QInt8)
    return dst


def gate(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """As export/parity.py's check_reduced: top-1 agreement, and the largest logit error over the mean spread."""
    agreement = float((got.argmax(1) == want.argmax(1)).mean())
    return agreement, float(np.abs(got - want).max() / np.ptp(want, axis=1).mean())


def speed(graphs: dict[str, Path], batches: list[int], rounds: int, size: int) -> dict[tuple[str, int], float]:
    """Median seconds per batch of each graph, interleaved round by round in a shuffled order."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count()
    sessions = {k: ort.InferenceSession(str(p), options, providers=["CPUExecutionProvider"])
                for k, p in graphs.items()}
    from export_speed import interleaved  # torch with it: only here, never under qemu
    medians = {}
    for batch in batches:
        batch_feeds = graph_inputs(np.random.default_rng(0).integers(0, 256, (batch, size, size, 3), dtype=np.uint8))
        runs = {k: partial(session.run, None, batch_feeds) for k, session in sessions.items()}
        medians.update({(k, batch): t for k, t in interleaved(runs, rounds, 8 if batch == 1 else 1).items()})
    return medians


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", nargs="+", choices=["ci", "shapes-vit"], default=["ci", "shapes-vit"])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    p.add_argument("--qemu-images", type=int, default=120,
                   help="shapes-vit: how many of the held-out images (evenly spaced) to run under qemu")
    p.add_argument("--no-qemu", action="store_true", help="this CPU only")
    p.add_argument("--rounds", type=int, default=15, help="speed rounds (0: no timing)")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--cache", type=Path, default=ROOT / "build" / "bench" / "int8_isa")
    args = p.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    qemu = None if args.no_qemu else isa.emulator()
    flags = {f for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
             for f in line.split(":")[1].split()}
    extensions = ", ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni") if f in flags)
    got, want = isa.probe()
    print(f"onnxruntime {ort.__version__}, {os.cpu_count()} threads; this CPU: {extensions}; u8×s8 probe here: {got} "
          f"(exact {want})")
    if qemu:
        verdict = ("saturates (the AVX2 kernel)" if isa.saturates() else
                   "does NOT saturate: not the AVX2 kernel, so the AVX2 columns show nothing")
        print(f"under {isa.QEMU} -cpu {isa.AVX2_ONLY}: the u8×s8 GEMM {verdict}")
    elif not args.no_qemu:
        print(f"{isa.QEMU} not installed (apt-get install qemu-user): this CPU only")

    header = (f"{'case':<10} {'variant':<22} {'images':>6} {'agree here':>10} {'err here':>8} {'AVX2 images':>11} "
              f"{'agree AVX2':>10} {'err AVX2':>8}" + "".join(f" {f'ms b{b}':>8} {'×fp32':>6}" for b in args.batches
                                                             if args.rounds))
    print(header)
    print("-" * len(header))
    for case in args.cases:
        if case == "ci":
            fp32, images = ci_case(args.cache)
            subset = images
        else:
            fp32 = ROOT / "model_repository" / "shapes-vit" / "model.onnx"
            images = heldout(ROOT / "data" / "shapes" / "val")
            subset = images[np.linspace(0, len(images) - 1, min(args.qemu_images, len(images))).astype(int)]
        calibration = images[np.linspace(0, len(images) - 1, min(64, len(images))).astype(int)]
        graphs = {v: quantize(fp32, v, args.cache / f"{case}.{v}.onnx", calibration) for v in args.variants}
        reference = isa.logits(fp32, images)
        here = {v: gate(isa.logits(g, images), reference) for v, g in graphs.items()}
        emulated = {}
        if qemu:
            start = time.monotonic()
            outs = isa.emulated_logits(list(graphs.values()), subset)
            emulated = {v: gate(o, isa.logits(fp32, subset)) for v, o in zip(graphs, outs)}
            print(f"({case}: {len(graphs)} graphs on {len(subset)} images under qemu in "
                  f"{time.monotonic() - start:.0f} s)", file=sys.stderr)
        times = speed({"fp32": fp32, **graphs}, args.batches, args.rounds, images.shape[1]) if args.rounds else {}
        for v in graphs:
            row = f"{case:<10} {v:<22} {len(images):>6} {here[v][0]:>10.3f} {here[v][1]:>8.1%} "
            row += (f"{len(subset):>11} {emulated[v][0]:>10.3f} {emulated[v][1]:>8.1%}" if emulated else
                    f"{'-':>11} {'-':>10} {'-':>8}")
            for b in args.batches if times else []:
                row += f" {times[v, b] * 1e3:>8.2f} {times['fp32', b] / times[v, b]:>5.2f}×"
            print(row, flush=True)
        if times:
            print(f"{case:<10} {'fp32':<22}" + " " * 60 + "".join(f" {times['fp32', b] * 1e3:>8.2f} {'':>6}"
                                                                   for b in args.batches), flush=True)


if __name__ == "__main__":
    main()
