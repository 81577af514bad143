"""ONNX Runtime: which device serves (decided once), which graph serves each model, and running one batch.

onnxruntime-gpu lists the CUDA provider even on hosts without CUDA 13 / cuDNN 9, and asking for it there
logs a raw loader error. So the device is chosen once at start-up, by opening one graph on CUDA with ORT's
logging muted and looking at what the session got; every model then opens on that device. CUDA and cuDNN
installed from PyPI (the `gpu` extra, the GPU image) live in site-packages, outside the loader's search path:
they are loaded first.
On CUDA, a model `NAME` with an fp16 sibling `NAME-fp16` runs the sibling's graph (one session for both names);
fp16 graphs are not served on the CPU, and graphs made for the CPU alone (int8) stay on it.
"""
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from repository import ModelEntry

log = logging.getLogger("vitserve")

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"


def open_session(path: Path, providers: list[str], threads: int = 0, spin_wait: bool = False,
                 tf32: bool = False) -> ort.InferenceSession:
    """A session on the first of `providers` that starts here (the CPU as the last resort). On CUDA, fp32 math
    uses TF32 tensor cores only with `tf32` (ORT's own default is on)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or os.cpu_count() or 1
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin_wait else "0")
    wanted = list(dict.fromkeys([p for p in providers if p in ort.get_available_providers()] + [CPU]))
    configured = [(p, {"use_tf32": str(int(tf32))}) if p == CUDA else p for p in wanted]
    ort.set_default_logger_severity(4)  # a provider that cannot start is expected here, not an error
    try:
        return ort.InferenceSession(str(path), options, providers=configured)
    finally:
        ort.set_default_logger_severity(2)


def choose_device(entries: list[ModelEntry], providers: list[str] | None) -> str:
    """CUDA if it is wanted and a session really starts on it here (tried on the smallest graph), else the CPU."""
    device = CPU
    if CUDA in (providers or [CUDA]) and CUDA in ort.get_available_providers() and entries:
        if importlib.util.find_spec("nvidia") is not None:  # CUDA/cuDNN wheels (onnxruntime-gpu[cuda,cudnn])
            ort.preload_dlls()
        smallest = min(entries, key=lambda e: e.path().stat().st_size)
        device = open_session(smallest.path(), [CUDA], threads=1).get_providers()[0]
        if device != CUDA:
            log.warning("CUDA is not usable on this host (onnxruntime-gpu needs CUDA 13 and cuDNN 9)")
    log.info("serving on %s (ONNX Runtime %s, providers built in: %s)", device, ort.__version__,
             ", ".join(ort.get_available_providers()))
    return device


@dataclass(frozen=True)
class Plan:
    """How one model name is served: the entry whose graph runs, its precision and provider, or why not."""
    name: str
    graph: str  # the name of the entry whose model.onnx runs (itself, or its fp16 sibling on CUDA)
    precision: str
    providers: tuple[str, ...]
    error: str | None = None

    @property
    def provider(self) -> str:
        return self.providers[0]


def serving_plan(entries: list[ModelEntry], device: str, providers: list[str] | None = None) -> dict[str, Plan]:
    """Which graph, precision and provider serve each model on `device` (pure: the decision is testable)."""
    by_name = {e.name: e for e in entries}
    plans = {}
    for entry in entries:
        meant = providers or entry.manifest.get("providers") or [CUDA, CPU]
        on_device = tuple(p for p in meant if p in (device, CPU)) or (CPU,)
        sibling = by_name.get(f"{entry.name}-fp16")
        if entry.precision == "fp16" and device != CUDA:
            plans[entry.name] = Plan(entry.name, entry.name, "fp16", on_device,
                                     "fp16 graphs are served on CUDA only, and CUDA is not usable here")
        elif sibling is not None and device == CUDA and entry.precision == "fp32":
            plans[entry.name] = Plan(entry.name, sibling.name, "fp16", (CUDA, CPU))
        else:
            plans[entry.name] = Plan(entry.name, entry.name, entry.precision, on_device)
    return plans


class Runner:
    """One graph's session; `run` takes (uint8 images [B1, H, W, 3], float pixel_values [B2, 3, H, W]) and
    returns every output by name, B1 + B2 rows, the images' first. `inputs`: the two inputs' names."""

    def __init__(self, path: Path, inputs: tuple[str, str], providers: list[str], threads: int = 0,
                 spin_wait: bool = False, tf32: bool = False):
        self.session = open_session(path, providers, threads, spin_wait, tf32)
        self.provider = self.session.get_providers()[0]
        self.input_names = inputs
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, images: np.ndarray, pixel_values: np.ndarray) -> dict[str, np.ndarray]:
        feeds = dict(zip(self.input_names, (images, pixel_values)))
        if self.provider == CUDA:
            # IOBinding: outputs stay on the device until one copy back, no per-run host allocations for them.
            binding = self.session.io_binding()
            for name, value in feeds.items():
                if hasattr(value, "__cuda_array_interface__"):  # decoded on the GPU: bound where it lies
                    binding.bind_input(name, "cuda", 0, value.dtype.type, list(value.shape),
                                       value.__cuda_array_interface__["data"][0])
                else:
                    binding.bind_cpu_input(name, value)
            for name in self.output_names:
                binding.bind_output(name, "cuda")
            self.session.run_with_iobinding(binding)
            return dict(zip(self.output_names, binding.copy_outputs_to_cpu()))
        return dict(zip(self.output_names, self.session.run(self.output_names, feeds)))
