"""Reduced-precision variants of an exported fp32 graph.

int8: dynamic quantization for the CPU provider. Only MatMul/Gemm are quantized: the default op list also
      takes the opset-23 Attention op and mis-quantizes it. Shape pre-processing skips the symbolic shape
      inference, which asserts on the Attention op.
fp16: for the CUDA provider, float32 inputs and outputs kept; the explicit attention-row Softmax stays in
      float32 (LayerNormalization accumulates in float32 by its own definition, stash_type=1).
"""
import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir
from onnxruntime.quantization import QuantType, quantize_dynamic
from onnxruntime.quantization.shape_inference import quant_pre_process
from onnxruntime.transformers.float16 import convert_float_to_float16

PRECISIONS = ("fp32", "fp16", "int8")
INT8_OP_TYPES = ["MatMul", "Gemm"]


def quantize_int8(src: Path, dst: Path, weight_type: QuantType = QuantType.QInt8,
                  per_channel: bool = False) -> onnx.ModelProto:
    """Signed per-tensor weights by default: the fastest on AVX2 (bench/export_speed.py --int8-variants)."""
    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        quant_pre_process(str(src), str(prepared), skip_symbolic_shape=True)
        quantize_dynamic(prepared, dst, op_types_to_quantize=INT8_OP_TYPES, weight_type=weight_type,
                         per_channel=per_channel)
    return onnx.load(dst)


def convert_fp16(src: Path, dst: Path) -> onnx.ModelProto:
    graph = ir.from_proto(convert_float_to_float16(onnx.load(src), keep_io_types=True, op_block_list=["Softmax"]))
    graph.graph.sort()  # the converter appends the inputs' Casts after the nodes that read them: invalid ONNX
    proto = ir.to_proto(graph)
    onnx.save_model(proto, dst)
    return proto


CONVERTERS = {"int8": quantize_int8, "fp16": convert_fp16}
