"""ONNX Runtime: which device serves (decided once), which graph serves each model, and running one batch.

onnxruntime-gpu lists the CUDA provider even on hosts without CUDA 13 / cuDNN 9, and asking for it there
logs a raw loader error. So the device is chosen once at start-up, by opening one graph on CUDA with ORT's
default logger muted (sessions keep their own warnings) and looking at what the session got; every model then
opens on that device. CUDA and cuDNN installed from PyPI (the `gpu` extra, the GPU image) live in site-packages,
outside the loader's search path: they are loaded first.
On CUDA, a model `NAME` with an fp16 sibling `NAME-fp16` runs the sibling's graph (one session for both names);
fp16 graphs are not served on the CPU, and graphs made for the CPU alone (int8) stay on it.
Small batches of images on CUDA can be replayed as CUDA graphs (`CudaGraph`), which saves the launch of every
kernel (docs/performance.md#h100-figures). A batch's images are gathered into page-locked host memory on CUDA
(`Runner.host_batch`), which the copy to the GPU reads at the bus's speed.
"""
import ctypes
import importlib.util
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import onnxruntime as ort

from repository import ModelEntry
from service.core.thread_names import name_pool_thread, named

log = logging.getLogger("vitserve")

CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"


def open_session(path: Path, providers: list[str], threads: int = 0, spin_wait: bool = False,
                 tf32: bool = False, cuda_graph_dims: dict[str, int] | None = None,
                 memory_arena: bool = True) -> ort.InferenceSession:
    """A session on the first of `providers` that starts here (the CPU as the last resort). With `spin_wait`, a
    CPU session's threads spin while a run lasts (not between runs); a CUDA session's never do, as they would
    through every run on the GPU. On CUDA, fp32 math uses TF32 tensor cores only with `tf32` (ORT's own default is
    on). `cuda_graph_dims`: the symbolic dimensions fixed at load for a session that CUDA captures as a graph
    (CudaGraph). Without `memory_arena` a CPU session frees what a run allocated when it ends, where ORT's arena
    would keep its peak for the next run."""
    wanted = list(dict.fromkeys([p for p in providers if p in ort.get_available_providers()] + [CPU]))
    options = ort.SessionOptions()
    options.enable_cpu_mem_arena = memory_arena
    options.intra_op_num_threads = threads or os.cpu_count() or 1
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin_wait and CUDA not in wanted
                                     else "0")
    options.add_session_config_entry("session.force_spinning_stop", "1")  # stop spinning when a run ends
    # The session's own warnings show at --log-level debug: graphs exported with input defaults (vitserve of
    # 2026-11-25/26) warn at every load that those are no constants
    options.log_severity_level = 2 if log.isEnabledFor(logging.DEBUG) else 3
    cuda = {"use_tf32": str(int(tf32))}
    if cuda_graph_dims:
        cuda["enable_cuda_graph"] = "1"
        for name, value in cuda_graph_dims.items():
            options.add_free_dimension_override_by_name(name, value)
    configured = [(p, cuda) if p == CUDA else p for p in wanted]
    # a provider that cannot start is expected here, not an error: ORT reports that on its default logger
    ort.set_default_logger_severity(4)
    try:
        with named("ort"):  # the session's thread pools
            return ort.InferenceSession(str(path), options, providers=configured)
    finally:
        ort.set_default_logger_severity(2)


def cuda_blocking_sync(device_id: int = 0) -> str | None:
    """Have the CUDA device's primary context (ONNX Runtime's and CuPy's) block a thread that waits on the GPU,
    where CUDA's default lets it spin a core while fewer contexts than cores exist; call before any session opens
    on CUDA. None when done, else why not (no libcuda: a host without an NVIDIA driver)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"no CUDA driver: {e}"
    device, blocking_sync = ctypes.c_int(), 0x04  # CU_CTX_SCHED_BLOCKING_SYNC
    # _v2 also applies to a context already active (CUDA >= 11); the plain name is the older driver's
    set_flags = getattr(cuda, "cuDevicePrimaryCtxSetFlags_v2", None) or cuda.cuDevicePrimaryCtxSetFlags
    for name, call, args in (("cuInit", cuda.cuInit, (0,)), ("cuDeviceGet", cuda.cuDeviceGet,
                                                               (ctypes.byref(device), device_id)),
                             ("cuDevicePrimaryCtxSetFlags", set_flags, (device, blocking_sync))):
        if status := call(*args):
            return f"{name} failed: CUresult {status}"
    return None


def graph_input(session: ort.InferenceSession, name: str) -> ort.NodeArg:
    """A graph input by name. Graphs exported on 2026-11-25/26 gave each input an empty-batch default, and ONNX
    Runtime lists such an input among the overridable initializers, not the inputs."""
    return next(i for i in [*session.get_inputs(), *session.get_overridable_initializers()] if i.name == name)


def choose_device(entries: list[ModelEntry], providers: list[str] | None) -> str:
    """CUDA if it is wanted and a session really starts on it here (tried on the smallest graph), else the CPU."""
    device = CPU
    if CUDA in (providers or [CUDA]) and CUDA in ort.get_available_providers() and entries:
        if importlib.util.find_spec("nvidia") is not None:  # CUDA/cuDNN wheels (onnxruntime-gpu[cuda,cudnn])
            ort.preload_dlls()
        smallest = min(entries, key=lambda e: e.path().stat().st_size)
        device = open_session(smallest.path(), [CUDA], threads=1).get_providers()[0]
        if device != CUDA:
            log.warning("CUDA is not usable on this host: no NVIDIA GPU and driver, or no CUDA 13 and cuDNN 9 "
                        "for onnxruntime-gpu")
    log.info("serving on %s (ONNX Runtime %s, providers built in: %s)", device, ort.__version__,
             ", ".join(ort.get_available_providers()))
    return device


def batches_in_flight(provider: str | None) -> int:
    """Batches a graph runs at once: one on a CPU (each already uses every core), two on a GPU (one is copied in
    and post-processed while the other computes)."""
    return 2 if provider == CUDA else 1


@dataclass(frozen=True)
class Plan:
    """How one model (version) is served: the entry whose graph runs, its precision and provider, or why not."""
    name: str  # the entry's key
    graph: str  # the key of the entry whose model.onnx runs (itself, or its fp16 sibling on CUDA)
    precision: str
    providers: tuple[str, ...]
    error: str | None = None

    @property
    def provider(self) -> str:
        return self.providers[0]


def serving_plan(entries: list[ModelEntry], device: str, providers: list[str] | None = None) -> dict[str, Plan]:
    """Which graph, precision and provider serve each model on `device` (pure: the decision is testable)."""
    by_key = {e.key: e for e in entries}
    plans = {}
    for entry in entries:
        key = entry.key
        meant = providers or entry.manifest.get("providers") or [CUDA, CPU]
        on_device = tuple(p for p in meant if p in (device, CPU)) or (CPU,)
        sibling = by_key.get(f"{key}-fp16")
        if entry.precision == "fp16" and device != CUDA:
            plans[key] = Plan(key, key, "fp16", on_device, "fp16 graphs are served on CUDA only, and CUDA is not "
                                                          "usable here")
        elif sibling is not None and device == CUDA and entry.precision == "fp32":
            plans[key] = Plan(key, sibling.key, "fp16", (CUDA, CPU))
        else:
            plans[key] = Plan(key, key, entry.precision, on_device)
    return plans


def graph_batches(max_batch: int) -> list[int]:
    """The batch sizes replayed as CUDA graphs: powers of two up to `max_batch`; a batch runs padded in the
    smallest that holds it."""
    return [1 << i for i in range(max_batch.bit_length())]


_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


@cache
def pinned_empty() -> Callable[[tuple[int, ...], type], np.ndarray] | None:
    """CuPy's `empty_pinned` (numpy arrays in page-locked host memory), or None where CuPy is missing or cannot
    allocate: copies to the GPU then read pageable memory, through the driver's staging buffer."""
    try:
        import cupyx
        cupyx.empty_pinned(1, np.uint8)
    except Exception as e:  # noqa: BLE001 - no CuPy, or no CUDA for it: plain memory still serves
        log.warning("batches are copied to the GPU from pageable memory: page-locked memory needs CuPy (the gpu "
                    "extra) and it is not usable here (%s: %s)", type(e).__name__, e)
        return None
    return cupyx.empty_pinned


class CudaGraph:
    """A graph for exactly `batch` images (and no float pixels), replayed as a CUDA graph. Its batch dimensions
    are fixed at load, so ONNX Runtime folds every shape computation away and nothing is left for the CPU (a
    capture needs that); its input and outputs lie at fixed GPU addresses, as a replay needs.

    Every run, the capture and each replay, happens on one thread of its own: ONNX Runtime keeps a CUDA graph per
    calling thread, so a second inference thread would capture it again while serving, in CUDA's global capture
    mode, where another thread's work on the GPU fails the capture. Its thread also makes the runs one at a time."""

    def __init__(self, path: Path, session: ort.InferenceSession, inputs: tuple[str, str], batch: int,
                 tf32: bool):
        self.batch = batch
        self.thread = ThreadPoolExecutor(1, thread_name_prefix=f"cuda-graph-{batch}", initializer=name_pool_thread)
        self.thread.submit(self._capture, path, session, inputs, tf32).result()

    def _capture(self, path: Path, session: ort.InferenceSession, inputs: tuple[str, str], tf32: bool) -> None:
        batch = self.batch
        images, tensors = (graph_input(session, name) for name in inputs)
        dims = {images.shape[0]: batch, tensors.shape[0]: 0}
        self.session = open_session(path, [CUDA], tf32=tf32, cuda_graph_dims=dims)
        if self.session.get_providers()[0] != CUDA:
            raise RuntimeError("the graph did not open on CUDA")
        self.binding = self.session.io_binding()
        self.images = ort.OrtValue.ortvalue_from_numpy(np.zeros([batch, *images.shape[1:]], np.uint8), "cuda", 0)
        self.binding.bind_ortvalue_input(images.name, self.images)
        no_tensors = np.zeros([0, *tensors.shape[1:]], np.float32)
        self.binding.bind_ortvalue_input(tensors.name, ort.OrtValue.ortvalue_from_numpy(no_tensors, "cuda", 0))
        self.outputs = [ort.OrtValue.ortvalue_from_shape_and_type([batch, *o.shape[1:]], _NUMPY[o.type], "cuda", 0)
                        for o in session.get_outputs()]
        for spec, value in zip(session.get_outputs(), self.outputs):
            self.binding.bind_ortvalue_output(spec.name, value)
        for _ in range(3):  # ONNX Runtime runs the graph plainly before it captures it: fail here, not later
            self.session.run_with_iobinding(self.binding)

    def run(self, images: np.ndarray) -> list[np.ndarray]:
        """Outputs for up to `batch` images, in the session's output order."""
        return self.thread.submit(self._replay, images).result()

    def _replay(self, images: np.ndarray) -> list[np.ndarray]:
        count = len(images)
        padded = images
        if count < self.batch:
            padded = np.zeros((self.batch, *images.shape[1:]), np.uint8)
            padded[:count] = images
        self.images.update_inplace(padded)
        self.session.run_with_iobinding(self.binding)
        return [value.numpy()[:count] for value in self.outputs]


class Runner:
    """One graph's session; `run` takes (uint8 images [B1, H, W, 3], float pixel_values [B2, 3, H, W]) and
    returns every output by name, B1 + B2 rows, the images' first. `inputs`: the two inputs' names. On CUDA,
    batches of up to `cuda_graph_max_batch` images (and no float pixels) run as CUDA graphs.

    On CUDA every run goes through IOBinding (the device path); `iobinding` takes the CPU through it too, so
    that hosts without a GPU (CI) run everything of that path that ONNX Runtime's CPU provider can."""

    def __init__(self, path: Path, inputs: tuple[str, str], providers: list[str], threads: int = 0,
                 spin_wait: bool = False, tf32: bool = False, cuda_graph_max_batch: int = 0,
                 iobinding: bool = False):
        self.session = open_session(path, providers, threads, spin_wait, tf32)
        self.provider = self.session.get_providers()[0]
        self.device = "cuda" if self.provider == CUDA else "cpu"
        self.iobinding = iobinding or self.provider == CUDA
        self.input_names = inputs
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.image_shape = tuple(graph_input(self.session, inputs[0]).shape[1:])
        self._empty = (pinned_empty() if self.provider == CUDA else None) or np.empty
        self._host = threading.local()  # each inference thread's batch buffer
        self.graphs: dict[int, CudaGraph] = {}
        if self.provider == CUDA:
            try:
                self.graphs = {b: CudaGraph(path, self.session, inputs, b, tf32)
                               for b in graph_batches(cuda_graph_max_batch)}
            except Exception as e:  # ONNX Runtime's errors derive from Exception alone; plain runs still serve
                log.warning("%s: no CUDA graphs (%s); small batches run as the others", path, e)
                self.graphs = {}

    def host_batch(self, count: int) -> np.ndarray:
        """An uninitialised uint8 [count, H, W, 3] array to gather a batch's images in, valid until this thread's
        next call. On the device path it is one buffer per inference thread, reused, and on CUDA it lies in
        page-locked memory: the copy to the GPU then reads it at the bus's speed, where from pageable memory it
        goes through the driver's staging buffer (on an H100 Runner fp16 ran 0.64x the session with its input on
        the GPU, DeiT-Ti at batch 256)."""
        if not self.iobinding:
            return np.empty((count, *self.image_shape), np.uint8)
        buffer = getattr(self._host, "images", None)
        if buffer is None or len(buffer) < count:
            # grown in powers of two: CuPy's pinned pool keeps each size it is given back, so few sizes reach it
            buffer = self._host.images = self._empty((1 << (count - 1).bit_length(), *self.image_shape), np.uint8)
        return buffer[:count]

    def run(self, images: np.ndarray, pixel_values: np.ndarray) -> dict[str, np.ndarray]:
        feeds = dict(zip(self.input_names, (images, pixel_values)))
        if not self.iobinding:
            return dict(zip(self.output_names, self.session.run(self.output_names, feeds)))
        if graph := self._graph_for(images, pixel_values):
            return dict(zip(self.output_names, graph.run(images)))
        # IOBinding: outputs stay on the device until one copy back, no per-run host allocations for them.
        binding = self.session.io_binding()
        for name, value in feeds.items():
            if hasattr(value, "__cuda_array_interface__"):  # decoded on the GPU: bound where it lies
                binding.bind_input(name, "cuda", 0, value.dtype.type, list(value.shape),
                                   value.__cuda_array_interface__["data"][0])
            else:
                # host memory as an OrtValue over it (no copy): bind_cpu_input finds only the names
                # session.get_inputs() lists, and an input with a default (graph_input) is not among them
                binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
        for name in self.output_names:
            binding.bind_output(name, self.device)
        self.session.run_with_iobinding(binding)
        return dict(zip(self.output_names, binding.copy_outputs_to_cpu()))

    def _graph_for(self, images, pixel_values: np.ndarray) -> CudaGraph | None:
        """The smallest CUDA graph that holds a batch of host images alone (none for GPU-decoded ones)."""
        if not isinstance(images, np.ndarray) or not len(images) or len(pixel_values):
            return None
        return next((g for b, g in self.graphs.items() if b >= len(images)), None)
