"""OpenVINO, a second CPU runtime on the same committed ONNX graphs (the `openvino` extra): fp32, bf16 through its
inference-precision hint on a CPU that has it (AVX512_BF16 or AMX), and the dynamic int8 graph. Its runner has
ONNX Runtime's Runner's face (run, host_batch, provider), so that the batcher, the records, attention maps and both
backends never know which runtime runs; cpu_plans.py chooses. ONNX Runtime stays the default, and CUDA's alone.

One inference request per thread that runs batches (an inference thread, or a decode thread running a lone
request's batch of one): a request is not to be used by two threads at once. The latency hint makes one stream
over every core, as a batch on the CPU should: the throughput hint makes several, and a lone request then runs on
one core (docs/performance.md#cpu-plans).
"""
import importlib.util
import os
import threading
from functools import cache
from pathlib import Path

import numpy as np

from .runtime import CPU

# what OpenVINO's INFERENCE_PRECISION_HINT is for a plan's precision: an int8 graph's own ops run as they are
HINTS = {"fp32": "f32", "bf16": "bf16", "int8": "f32"}


def available() -> bool:
    """Whether OpenVINO is installed (the `openvino` extra)."""
    return importlib.util.find_spec("openvino") is not None


@cache
def _core():
    import openvino
    return openvino.Core()


@cache
def capabilities() -> frozenset[str]:
    """What OpenVINO's CPU plugin says this CPU computes natively: FP32, BF16 (AVX512_BF16 or AMX), INT8, ..."""
    return frozenset(_core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")) if available() else frozenset()


class OpenVinoRunner:
    """One graph compiled for the CPU at a precision; `run` takes (uint8 images [B1, H, W, 3], float pixel_values
    [B2, 3, H, W]) and returns every output by name, B1 + B2 rows, the images' first (Runner's contract)."""

    provider, device = CPU, "cpu"  # it runs where ONNX Runtime's CPU provider would

    def __init__(self, path: Path, inputs: tuple[str, str], precision: str, threads: int = 0):
        core = _core()
        model = core.read_model(str(path))
        self.compiled = core.compile_model(model, "CPU", {
            "INFERENCE_PRECISION_HINT": HINTS[precision], "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_NUM_THREADS": threads or os.cpu_count() or 1})
        self.input_names = inputs
        self.output_names = [output.get_any_name() for output in self.compiled.outputs]
        self.image_shape = tuple(d.get_length() for d in model.input(inputs[0]).get_partial_shape()[1:])
        self._requests = threading.local()

    def host_batch(self, count: int) -> np.ndarray:
        """An uninitialised uint8 [count, H, W, 3] array to gather a batch's images in."""
        return np.empty((count, *self.image_shape), np.uint8)

    def run(self, images: np.ndarray, pixel_values: np.ndarray) -> dict[str, np.ndarray]:
        request = getattr(self._requests, "request", None)
        if request is None:
            request = self._requests.request = self.compiled.create_infer_request()
        answer = request.infer(dict(zip(self.input_names, (images, pixel_values))))  # (outputs copied out)
        return {name: answer[output] for name, output in zip(self.output_names, self.compiled.outputs)}
