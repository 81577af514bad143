"""ONNX Runtime's fused CUDA kernels written into the fp16 graph.

A pre-norm transformer block is MatMul -> bias Add -> residual Add -> LayerNorm, twice. ONNX Runtime's own
SkipLayerNormFusion never fires on it: the residual sum also feeds the next residual Add, and that fusion
wants it to have one consumer. Left apart, those Adds took 20% of DeiT-S's fp16 time on an H100. Here the
bias, the residual sum and the LayerNorm become one com.microsoft SkipLayerNormalization (its fourth output
carries the sum onward), and the MLP's bias + GELU one BiasGelu, with onnxscript's ORT fusion rules. They match
on shapes, so they run on the graph as exported, whose shapes carry PyTorch's batch symbols.

Only the fp16 graph (the CUDA provider's) is fused: the fp32 graph stays standard ONNX for any runtime, and
the int8 quantizer cannot type com.microsoft ops' outputs.
"""
import onnx_ir as ir
from onnxscript.rewriter.ort_fusions.bias_gelu import fuse_bias_gelu
from onnxscript.rewriter.ort_fusions.skip_normalization import fuse_skip_layer_normalization


def fuse_for_ort(graph: ir.Model) -> dict[str, int]:
    """Rewrite `graph` in place; how many of each fused op it made."""
    made = {"SkipLayerNormalization": fuse_skip_layer_normalization(graph), "BiasGelu": fuse_bias_gelu(graph)}
    for node in graph.graph:
        if node.op_type == "SkipLayerNormalization":
            # the mean and inverse deviation: absent, as in ORT's own fused form (its CUDA kernel never makes them)
            for unused in (v for v in node.outputs[1:3] if not v.uses()):
                unused.name = ""
    return made
