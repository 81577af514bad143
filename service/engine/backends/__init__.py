"""Where batches run: the seam between the HTTP side and the inference side.

Two backends, one interface:
  LocalBackend (local.py):     ONNX Runtime sessions and the dynamic batchers in this process, batches run in
                               an inference thread (its models' loading, readiness and reloads: lifecycle.py).
                               The default on a CPU host: each batch already uses every core.
  ProcessBackend (process.py): this process is one of several HTTP workers; it decodes into records in shared
                               memory and hands them to one inference process (inference_process.py), which owns the
                               sessions and the batchers. The default on a CUDA host, where one GIL-bound
                               process cannot decode and post-process fast enough to keep the GPU busy.
"""
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import numpy as np

from repository import ModelEntry
from service.core.errors import ServiceError
from service.explain.cache import AttentionResult

from ..runtime import CUDA
from ..shared_memory import SharedIO
from ..side_graphs import Batch


class DecodeOn(StrEnum):
    """Where a model's JPEG uploads are decoded."""
    CPU = "cpu"  # in the decode threads of the process that took the request
    GPU = "gpu"  # sent undecoded, and decoded with their batch on the GPU (images/gpu_decode.py)


@dataclass
class ModelStatus:
    """What serves a model name, as decided at start-up, and whether it is ready."""
    ready: bool = False
    error: str | None = None
    provider: str | None = None
    precision: str | None = None  # what runs: an fp32 model with an fp16 sibling runs in fp16 on CUDA
    graph: str | None = None  # the model whose model.onnx runs for this name
    decode: DecodeOn = DecodeOn.CPU
    # why decode is CPU although the graph runs on CUDA with GPU decoding on (else None): never a silent fallback
    decode_reason: str | None = None
    unloaded: bool = False  # taken out of service (POST /v2/repository/models/NAME/unload): requests get 404
    loads: int = 1  # how many times it was (re)loaded: a worker re-reads its manifest when this changes
    last_failure: str | None = None  # why the last (re)load failed, while what served before still serves
    # on the CPU: the plan that runs it (RUNTIME:PRECISION, engine/cpu_plans.py), why, and the images/s measured of
    # each plan by batch size where several could run
    plan: str | None = None
    plan_reason: str | None = None
    plan_measured: dict[str, dict[str, float]] | None = None

    @property
    def settled(self) -> bool:
        """Not loading: serving, failed, or unloaded."""
        return self.ready or self.error is not None or self.unloaded

    @property
    def runs(self) -> str | None:
        """What computes its answers, as each answer names it: RUNTIME:PRECISION (the CPU plan, or onnxruntime-cuda
        and the precision that runs on CUDA); None before it serves."""
        if self.plan is not None or self.precision is None:
            return self.plan
        return f"onnxruntime{'-cuda' if self.provider == CUDA else ''}:{self.precision}"


def graph_entry(entries: list[ModelEntry], status: dict[str, ModelStatus], key: str) -> ModelEntry:
    """The model version whose graph runs a model version's batches (its status says which; itself until then):
    whose manifest's batching it has (BatchingPolicy)."""
    graph = getattr(status.get(key), "graph", None) or key
    return next(e for e in entries if e.key == graph)


@dataclass(eq=False)
class Lease:
    """Records a request holds (records.py): what Backend.records gives, to fill and to run. The process backend's
    are slots of the worker's shared memory (process.Slots)."""
    records: np.ndarray


class ModelControl(Protocol):
    """What administers the models (Triton's model control: load, unload, the repository index), by model name:
    the in-process lifecycle (lifecycle.py), or under the process backend the inference process's, asked."""

    async def load(self, model: str) -> None:
        """(Re)load the versions of a model that its folder's policy serves, beside what serves it now, then switch
        to them: requests already queued or running finish on the old sessions. A failure leaves what served
        serving and says why (RepositoryError's message, as BadInput)."""

    async def unload(self, model: str) -> None:
        """Stop serving a model's versions once the requests they accepted are answered; later ones: NotFound."""

    async def index(self) -> list[dict]:
        """Every model version of the repository with its state (READY, LOADING, UNAVAILABLE) and the reason."""


class Backend(Protocol):
    """What runs batches: the serving calls name a model version by its key (ModelEntry.key: NAME, or
    NAME@VERSION). Beside them: shared-memory regions and the attention results kept for GET /attention-map, which
    live where the batches run; and `models`, what administers them."""

    entries: list[ModelEntry]  # the model versions served, each by its key (known once `start` returned)
    generation: int  # counts status changes: what serves which name may have changed
    problems: dict[str, str]  # repository folders that cannot be served, with why
    models: ModelControl

    async def start(self) -> None:
        """Know the models; sessions load and warm up in the background after this returns."""

    async def loaded(self) -> None:
        """Return once every model is warm or has failed."""

    def status(self) -> dict[str, ModelStatus]: ...

    def problem(self) -> ServiceError | None:
        """Why nothing can be served now, whatever the models' status (the inference process restarting, or hung),
        as the error requests and readiness answer with; None where it serves."""

    def records(self, model: str, kind: str, n: int) -> AbstractContextManager[Lease]:
        """n empty records of a kind (records.Kind) to fill, held inside the `with`."""

    def preparing(self, model: str) -> AbstractContextManager[None]:
        """Around decoding images that will run on `model` (the batcher may wait for them)."""

    def gpu_room(self, model: str) -> int:
        """How many JPEGs the model's GPU decoder takes now, before its queue holds VITSERVE_GPU_DECODE_QUEUE_BATCHES
        batches per inference thread (where its status says DecodeOn.GPU): the decode router's reading."""

    def run_here(self, model: str, lease: Lease, top_k: int, trace: str | None = None) -> bool:
        """From a decode thread, once the lease's records are filled: run them in that thread if the model is idle,
        and say whether it did (a lone request spared two thread hops); where it did not, `run` them. `trace`: the
        request's traceparent, where traces are on (tracing.py)."""

    async def run(self, model: str, lease: Lease, top_k: int, jpegs: list[bytes] | None = None,
                  shared: SharedIO | None = None) -> None:
        """Batch, run and unbatch: results are in the lease's records when it returns (for Kind.JPEG records, `jpegs`
        holds their bytes), and in shared memory where `shared` says (its input, if it names one, is read from there,
        and the records' input is not). Overloaded: Unavailable; a slice of a region that is not registered or too
        small: BadInput."""

    async def explain(self, model: str, image: np.ndarray) -> list[np.ndarray]:
        """Every layer's attention probabilities for one uint8 [H, W, 3] input (the explain graph)."""

    async def side(self, model: str, name: str, inputs: Batch) -> Batch:
        """Items run on the model's side graph `name` (side_graphs.py), batched across requests: a row per item of
        each of its input fields -> a row per item of each of its output fields. BadInput where the model has no
        such graph."""

    async def register_region(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """A client's system shared memory, registered under `name` (shared_memory.Regions.register)."""

    async def unregister_region(self, name: str) -> None:
        """The region (every region, where `name` is empty) unregistered; BadInput while a request uses it."""

    async def region_status(self, name: str) -> list[dict]:
        """The regions registered (the one named, where `name` is not empty): name, key, offset, byte_size."""

    async def store_attention(self, key: str, result: AttentionResult) -> bool:
        """Store an attention result for GET /attention-map; False if it does not fit."""

    async def recall_attention(self, key: str) -> AttentionResult | None: ...

    async def close(self) -> None:
        """Finish what was accepted, then release the sessions."""
