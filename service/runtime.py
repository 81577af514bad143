"""ONNX Runtime sessions: which providers really work here, and running one batch.

onnxruntime-gpu lists the CUDA provider even on hosts without CUDA 13 / cuDNN 9, and asking for it there
logs a raw loader error. Sessions are therefore opened with ORT's logging muted, and the provider the
session actually got decides; a host without a working CUDA gets one clear log line and the CPU.
"""
import logging
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

log = logging.getLogger("vitserve")

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
_cuda_warned = False


def open_session(path: Path, providers: list[str], threads: int = 0, spin_wait: bool = False) -> ort.InferenceSession:
    """A session on the first of `providers` that starts here (the CPU as the last resort)."""
    global _cuda_warned
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or os.cpu_count() or 1
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin_wait else "0")
    wanted = [p for p in providers if p in ort.get_available_providers()]
    wanted = list(dict.fromkeys(wanted + [CPU]))
    ort.set_default_logger_severity(4)  # a provider that cannot start is expected here, not an error
    try:
        session = ort.InferenceSession(str(path), options, providers=wanted)
    finally:
        ort.set_default_logger_severity(2)
    if CUDA in providers and session.get_providers()[0] != CUDA and not _cuda_warned:
        _cuda_warned = True
        log.info("CUDA is not usable on this host (onnxruntime-gpu needs CUDA 13 and cuDNN 9); serving on the CPU")
    return session


class Runner:
    """One model's session; `run` takes a float32 NCHW batch and returns every output by name."""

    def __init__(self, path: Path, providers: list[str], threads: int = 0, spin_wait: bool = False):
        self.session = open_session(path, providers, threads, spin_wait)
        self.provider = self.session.get_providers()[0]
        self.input_name = self.session.get_inputs()[0].name
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, batch: np.ndarray) -> dict[str, np.ndarray]:
        if self.provider == CUDA:
            # IOBinding: outputs stay on the device until one copy back, no per-run host allocations for them.
            binding = self.session.io_binding()
            binding.bind_cpu_input(self.input_name, batch)
            for name in self.output_names:
                binding.bind_output(name, "cuda")
            self.session.run_with_iobinding(binding)
            return dict(zip(self.output_names, binding.copy_outputs_to_cpu()))
        return dict(zip(self.output_names, self.session.run(self.output_names, {self.input_name: batch})))
