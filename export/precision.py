"""Reduced-precision variants of an exported fp32 graph.

int8: dynamic quantization for the CPU provider. Only MatMul/Gemm are quantized: the default op list also
      takes the opset-23 Attention op and mis-quantizes it. Shape pre-processing skips the symbolic shape
      inference, which asserts on the Attention op.
      Activations are u8 (computed per batch), weights s8 per tensor in 7 bits, [-64, 64] (`reduce_range`), so
      that the graph answers alike on every x86 CPU. ONNX Runtime's u8×s8 GEMM on a CPU with AVX2 but no VNNI
      (Intel before Ice Lake/Alder Lake, AMD before Zen 4) adds each pair of products into a saturating int16
      (`vpmaddubsw`; export/isa.py): with 8-bit weights a pair reaches 255·127·2 = 64770 and is clamped to
      32767; with 7-bit ones it is at most 255·64·2 = 32640, which fits whatever the input. AVX-512 VNNI and
      AVX-VNNI sum in int32 and never saturate. It is the remedy ONNX Runtime's quantization guide gives for
      U8S8 on AVX2 and AVX-512 without VNNI. With 8-bit weights (the export until 2026-11-27) an AVX2-only CI
      host failed tests/test_export.py's gate that AVX-512 VNNI passed. Measured (`python bench/int8_isa.py`:
      top-1 agreement and largest logit error in % of the spread against fp32, on an AVX-512 VNNI EPYC and
      under `qemu-x86_64 -cpu Haswell` as an AVX2 CPU; speed int8 ÷ fp32 on the VNNI CPU, DeiT-S at batch
      1 / 16, `python bench/export_speed.py --rounds 15 --int8-variants`):
        weights                  random ViT, 24 images    shapes-vit, 1200 (AVX2: 120)     DeiT-S speed
                                 VNNI         AVX2        VNNI         AVX2
        s8 8-bit (until 11-27)   1.000  3.2%  0.542 43.6%  1.000  5.3%  1.000  4.0%         1.82× / 2.14×
        s8 7-bit (the export)    1.000  4.9%  1.000  4.7%  0.999  7.0%  1.000  3.2%         1.75× / 2.15×
        s8 8-bit per channel     1.000  2.0%  0.458 42.3%  1.000  4.8%  0.833 94.2%         1.74× / 2.17×
        s8 7-bit per channel     0.958  5.1%  0.958  5.0%  0.999  5.0%  1.000  3.3%         1.75× / 2.15×
        u8 weights (U8U8)        1.000  2.6%  1.000  2.6%  0.999  4.3%  1.000  4.6%         1.30× / 1.47×
        S8S8 QDQ, static         1.000  3.4%  0.458 43.3%  0.998  8.8%  1.000  6.4%   (shapes-vit 1.28× / 1.13×)
      Why 7-bit per tensor: it is the one s8 format that cannot saturate, and runs the same kernel as 8-bit at
      the same speed. 8-bit per channel saturates as per tensor does (each column's largest weight is still
      ±127); so does S8S8 QDQ (on x86 ONNX Runtime turns s8 activations into u8 for the same kernel). U8U8
      cannot saturate either but is a quarter to a third slower; 7-bit per channel lost a near-tie of the
      random ViT on both. The price is precision: shapes-vit-int8 agrees with fp32 on 1199 of 1200 held-out
      images (8-bit: all), logit error 7.0% (8-bit: 5.3%), the same under emulated AVX2. docs/export.md has more.
fp16: for the CUDA provider, float32 inputs and outputs kept; the explicit attention-row Softmax stays in
      float32 (LayerNormalization accumulates in float32 by its own definition, stash_type=1).
"""
import importlib.util
import tempfile
from pathlib import Path
from types import SimpleNamespace

import onnx
import onnx_ir as ir
from onnxruntime.quantization import QuantType, quantize_dynamic
from onnxruntime.quantization.shape_inference import quant_pre_process
from onnxruntime.transformers.float16 import convert_float_to_float16

PRECISIONS = ("fp32", "fp16", "int8", "auto")
INT8_OP_TYPES = ["MatMul", "Gemm"]


# The weight formats bench/int8_isa.py and bench/export_speed.py --int8-variants compare (module docstring);
# the export writes INT8_WEIGHTS
INT8_VARIANTS = {
    "u8s8": {"weight_type": QuantType.QInt8, "per_channel": False, "reduce_range": False},
    "u8s8-7bit": {"weight_type": QuantType.QInt8, "per_channel": False, "reduce_range": True},
    "u8s8-per-channel": {"weight_type": QuantType.QInt8, "per_channel": True, "reduce_range": False},
    "u8s8-per-channel-7bit": {"weight_type": QuantType.QInt8, "per_channel": True, "reduce_range": True},
    "u8u8": {"weight_type": QuantType.QUInt8, "per_channel": False, "reduce_range": False},
}
INT8_WEIGHTS = "u8s8-7bit"
INT8_WEIGHT_RANGE = (-64, 64)  # what reduce_range gives s8 weights: 2 · 255 · 64 fits an int16


def quantize_int8(src: Path, dst: Path, weight_type: QuantType = QuantType.QInt8, per_channel: bool = False,
                  reduce_range: bool = True) -> onnx.ModelProto:
    """Dynamic quantization of MatMul/Gemm; by default as the export does (INT8_WEIGHTS: s8 weights per tensor
    in 7 bits), or another of INT8_VARIANTS."""
    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        quant_pre_process(str(src), str(prepared), skip_symbolic_shape=True)
        quantize_dynamic(prepared, dst, op_types_to_quantize=INT8_OP_TYPES, weight_type=weight_type,
                         per_channel=per_channel, reduce_range=reduce_range)
    return onnx.load(dst)


def convert_fp16(src: Path, dst: Path) -> onnx.ModelProto:
    graph = ir.from_proto(convert_float_to_float16(onnx.load(src), keep_io_types=True, op_block_list=["Softmax"]))
    graph.graph.sort()  # the converter appends the inputs' Casts after the nodes that read them: invalid ONNX
    proto = ir.to_proto(graph)
    onnx.save_model(proto, dst)
    return proto


CONVERTERS = {"int8": quantize_int8, "fp16": convert_fp16}


class OpenVinoSession:
    """A graph compiled by OpenVINO for the CPU at a precision, with the face of an ONNX Runtime session that the
    gate uses (run, get_outputs, get_providers). OpenVINO is the `openvino` extra: imported only here."""

    HINTS = {"fp32": "f32", "bf16": "bf16", "int8": "f32"}  # an int8 graph's own ops run as they are

    def __init__(self, path: Path, precision: str):
        import openvino
        self.compiled = openvino.Core().compile_model(str(path), "CPU", {
            "INFERENCE_PRECISION_HINT": self.HINTS[precision], "PERFORMANCE_HINT": "LATENCY"})
        self.precision = precision

    def run(self, names: None, feeds: dict) -> list:
        answer = self.compiled.create_infer_request().infer(feeds)
        return [answer[output] for output in self.compiled.outputs]

    def get_outputs(self) -> list:
        return [SimpleNamespace(name=output.get_any_name()) for output in self.compiled.outputs]

    def get_providers(self) -> list[str]:
        return [f"OpenVINO CPU {self.precision}"]


def openvino_capabilities() -> frozenset[str] | None:
    """What OpenVINO's CPU plugin computes natively here (BF16 where the CPU has AVX512_BF16 or AMX), or None
    without OpenVINO."""
    if importlib.util.find_spec("openvino") is None:
        return None
    import openvino
    return frozenset(openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
