"""Graphs run as another x86 CPU would run them: through qemu-user, for the int8 gate on an AVX2-only CPU.

ONNX Runtime's MLAS picks its u8×s8 GEMM kernel (what the int8 graph's MatMuls run) by CPUID when it loads.
With AVX-512 VNNI or AVX-VNNI it multiplies and sums in int32 (`vpdpbusd`). With AVX2 alone (Intel before
Ice Lake/Alder Lake, AMD before Zen 4) it adds each pair of u8×s8 products into a saturating int16
(`vpmaddubsw`): 255·127 + 255·127 = 64770 is clamped to 32767, and a graph whose weights use all of int8's range
answers differently on that CPU (export/precision.py). `qemu-x86_64 -cpu Haswell` (qemu ≥ 7.2 emulates AVX2)
runs this same Python and ONNX Runtime as such a CPU; `saturates` checks that MLAS took the AVX2 kernel there.

    python -m export.isa --probe                    # here: does a u8×s8 MatMul saturate?
    qemu-x86_64 -cpu Haswell .venv/bin/python -m export.isa --probe

Only numpy and ONNX Runtime are imported here (torch under qemu would take minutes to import).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

QEMU = "qemu-x86_64"
AVX2_ONLY = "Haswell"  # AVX2 and FMA, no AVX-512, no VNNI
PROBE_K = 64


def emulator() -> str | None:
    """qemu-user's x86-64 emulator, if installed (Debian: apt-get install qemu-user)."""
    return shutil.which(QEMU)


def logits(graph: Path, images: np.ndarray, batch: int = 64) -> np.ndarray:
    """The graph's first output (logits) for uint8 NHWC `images`, fed through its `images` input."""
    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    size = images.shape[1:3]
    no_pixels = np.zeros((0, 3, *size), np.float32)
    first = session.get_outputs()[0].name
    return np.concatenate([session.run([first], {"images": images[i:i + batch], "pixel_values": no_pixels})[0]
                           for i in range(0, len(images), batch)])


def probe() -> tuple[int, int]:
    """A u8×s8 MatMulInteger of 255s by 127s (what a DynamicQuantizeMatMul computes): what it gives, and what it
    should. The AVX2 kernel gives 32767 per pair of products instead of 64770."""
    from onnx import TensorProto, helper  # onnx imports quickly; only the probe needs it
    weights = helper.make_tensor("b", TensorProto.INT8, [PROBE_K, 16], np.full(PROBE_K * 16, 127, np.int8))
    graph = helper.make_graph([helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "probe",
                              [helper.make_tensor_value_info("a", TensorProto.UINT8, [None, PROBE_K])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, [None, 16])], [weights])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"a": np.full((4, PROBE_K), 255, np.uint8)})[0]
    return int(got[0, 0]), 255 * 127 * PROBE_K


def _emulated(cpu: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    qemu = emulator()
    if qemu is None:
        raise RuntimeError(f"{QEMU} is not installed (Debian: apt-get install qemu-user)")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([qemu, "-cpu", cpu, sys.executable, "-m", "export.isa", *args], env=env, cwd=root,
                         capture_output=True, text=True, timeout=timeout)
    if run.returncode:
        # qemu's own warnings ("TCG doesn't support requested feature ...") are left out of the message
        errors = "\n".join(line for line in run.stderr.splitlines() if not line.startswith(f"{QEMU}: warning"))
        raise RuntimeError(f"{QEMU} -cpu {cpu} failed ({run.returncode}): {errors[-2000:]}")
    return run


def saturates(cpu: str = AVX2_ONLY, timeout: float = 120) -> bool:
    """Whether ONNX Runtime's u8×s8 GEMM saturates on `cpu` (under qemu), i.e. took the AVX2 kernel."""
    got, want = map(int, _emulated(cpu, ["--probe"], timeout).stdout.split())
    return got != want


def emulated_logits(graphs: list[Path], images: np.ndarray, cpu: str = AVX2_ONLY,
                    timeout: float = 1800) -> list[np.ndarray]:
    """Each graph's logits for uint8 NHWC `images`, computed under `qemu-x86_64 -cpu CPU`."""
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "images.npy", images)
        _emulated(cpu, ["--images", str(Path(tmp) / "images.npy"), "--out", str(Path(tmp) / "logits.npz"),
                        *map(str, graphs)], timeout)
        with np.load(Path(tmp) / "logits.npz") as saved:
            return [saved[f"g{i}"] for i in range(len(graphs))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--probe", action="store_true", help="print what a u8×s8 MatMul of 255s by 127s gives, and its "
                                                        "exact value")
    p.add_argument("--images", type=Path, help="a .npy of uint8 [N, H, W, 3] images")
    p.add_argument("--out", type=Path, help="where to write the graphs' logits (.npz, g0, g1, ...)")
    p.add_argument("graphs", nargs="*", type=Path)
    args = p.parse_args()
    if args.probe:
        print(*probe())
        return
    images = np.load(args.images)
    np.savez(args.out, **{f"g{i}": logits(g, images) for i, g in enumerate(args.graphs)})


if __name__ == "__main__":
    main()
