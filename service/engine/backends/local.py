"""The in-process backend: ONNX Runtime sessions, one dynamic batcher per graph, batches in an inference thread.

Start-up reads the repository at once (a broken repository fails start-up); the device is chosen once, then
sessions open and warm up in the background (lifecycle.py, which also (re)loads and unloads models while serving),
so /health/live answers at once and /health/ready turns 200 when every model is warm. The inference server of the
process backend is this backend behind a socket.
"""
import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from functools import partial

import numpy as np

from repository import ModelEntry, verify_file
from service.core import tracing
from service.core.errors import BadInput, NotFound, ServiceError, Unavailable, overloaded
from service.core.metrics import Metrics
from service.core.settings import Settings
from service.core.thread_names import name_pool_thread
from service.core.urgency import request_priority
from service.explain.cache import AttentionCache, AttentionResult
from service.images.decode import upload_input

from ..batching import Batcher, QueueFull
from ..cpu_plans import CpuPlan, open_runner
from ..openvino_runtime import OpenVinoRunner
from ..heads import head
from ..records import Kind, Part, gather, host_inputs, kind_of, record_dtype, row_numbers, scatter, spans, write_results
from ..runtime import Runner, batches_in_flight, choose_device, cuda_blocking_sync
from ..shared_memory import Regions, SharedIO
from ..side_graphs import SIDE_GRAPHS, Batch, SideGraph
from . import Lease, ModelStatus
from .board import BOARD_SLOTS, Board, Boards
from .device_health import DeviceHealth, run_isolating
from .lifecycle import ModelLifecycle, input_names

log = logging.getLogger("vitserve")


class LocalBackend:
    def __init__(self, settings: Settings, metrics: Metrics, on_status: Callable[[], None] = lambda: None,
                 on_broken: Callable[[str], None] = lambda why: None):
        """`on_status`: called on every change of the models' status; `on_broken`: what the process does once its
        device fails every batch (device_health.py), beside answering 503 `device_failed` to readiness and
        requests from then on."""
        self.settings, self.metrics = settings, metrics
        self.health = DeviceHealth(settings.device_broken_batches, settings.device_broken_s, on_broken)
        self.models = ModelLifecycle(settings, metrics, self, on_status)  # reads the repository: it fails here
        self.batchers: dict[str, Batcher] = {}  # by graph
        # by (graph, side graph: side_graphs.py), started on first use: maps and texts batch apart from images
        self.side_batchers: dict[tuple[str, str], Batcher] = {}
        self.cache = AttentionCache(settings.attention_cache_items, settings.attention_cache_bytes,
                                    settings.attention_ttl_s)
        self.regions = Regions()  # clients' system shared memory
        self.inference: ThreadPoolExecutor | None = None
        self.concurrency = 1  # batches in flight per graph, decided with the device
        # requests decoding for each model (entries' order): this process's, and the HTTP workers' under the
        # process backend (board.py)
        self.boards = Boards()
        # JPEGs each model's GPU decoder takes before its queue is full (entries' order; decode router: pipeline.py),
        # in shared memory that the HTTP workers read under the process backend (inference_process.py)
        self.jpeg_room = Board(np.zeros(BOARD_SLOTS, np.int32))

    @property
    def entries(self) -> list[ModelEntry]:
        return self.models.entries

    @property
    def generation(self) -> int:
        return self.models.generation

    @property
    def problems(self) -> dict[str, str]:
        return self.models.problems

    # -- start-up ------------------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.settings.cuda_blocking_sync and (problem := cuda_blocking_sync()):  # before any CUDA context
            log.warning("VITSERVE_CUDA_BLOCKING_SYNC is not applied: %s", problem)
        device = await loop.run_in_executor(None, choose_device, self.entries, self.settings.providers)
        self.concurrency = batches_in_flight(device)  # as many inference threads
        self.inference = ThreadPoolExecutor(self.concurrency, thread_name_prefix="infer", initializer=name_pool_thread)
        self.models.start(device)

    async def loaded(self) -> None:
        await self.models.loaded()

    # -- the graphs' batching (lifecycle.Graphs) ----------------------------------------------------------
    def serve_graph(self, graph: str) -> None:
        policy = self.models.batching(graph)
        models = [i for i, e in enumerate(self.entries) if self.models.plans[e.key].graph == graph]  # (board index)
        self.batchers[graph] = Batcher(graph, self._run_batch(graph), self.inference, self.metrics, policy,
                                       self.concurrency, partial(self.boards.coming, models),
                                       partial(self._tell_jpeg_room, graph, models))
        self._tell_jpeg_room(graph, models)
        self.batchers[graph].start()

    def rebatch_graph(self, graph: str) -> None:
        self.batchers[graph].policy = self.models.batching(graph)

    def _tell_jpeg_room(self, graph: str, models: list[int]) -> None:
        """The room in the graph's GPU decoder queue (VITSERVE_GPU_DECODE_QUEUE_BATCHES batches per inference
        thread, less the JPEGs waiting), for each of its models."""
        limit = self.settings.gpu_decode_queue_batches * self.batchers[graph].policy.max_batch_size * self.concurrency
        for i in models:
            self.jpeg_room.tell(i, max(0, int(limit) - self.batchers[graph].jpegs))

    async def graph_settled(self, graph: str) -> None:
        await self.batchers[graph].settled()

    async def close_graph(self, graph: str) -> None:
        await self.batchers[graph].drained()
        await self.batchers.pop(graph).stop()
        for side in [side for side in self.side_batchers if side[0] == graph]:
            await self.side_batchers[side].drained()
            await self.side_batchers.pop(side).stop()

    def _run_batch(self, graph: str):
        models = self.models
        policy = models.by_key[graph].policy  # a reload keeps the records' layout, the input size with it

        observe = self.metrics.phase_observer(graph)

        def run(parts: list[Part], queue_ms: list[float]) -> float:
            if (broken := self.problem()) is not None:
                raise broken
            start = time.perf_counter()
            runner = models.runners[graph]  # taken per batch: a reload switches it between batches
            batch = spans(parts)
            try:
                images, tensors = host_inputs(batch, policy.size, runner.host_batch)
                if jpegs := [p for p in parts if p.kind == Kind.JPEG]:
                    images = self._decode_jpegs(graph, jpegs, images)
                gathered = time.perf_counter()
                outputs, failed = run_isolating(runner.run, images, tensors)
            except Exception as e:
                self.health.failed(e)
                raise
            self.health.ran()
            fail_rows(parts, {row: ServiceError(f"inference failed on this image: {type(e).__name__}: {e}",
                                                "inference_failed") for row, e in failed.items()})
            elapsed = time.perf_counter() - gathered
            output_ms = write_results(batch, outputs, queue_ms, elapsed * 1e3, (gathered - start) * 1e3,
                                      head(models.by_key[graph]))
            observe(sum(p.size for p in parts), (gathered - start, elapsed, output_ms / 1e3))
            return elapsed

        return run

    def _decode_jpegs(self, graph: str, parts: list[Part], host_images: np.ndarray):
        """The JPEG parts decoded on the GPU, followed by the host images: the batch's images, on the device. A
        JPEG that neither nvImageCodec nor Pillow can read fails its own request only."""
        decoder, policy = self.models.jpeg_decoders[graph], self.models.by_key[graph].policy
        jpegs = [data for part in parts for data in part.inputs]
        decoded, errors = decoder.decode(jpegs, lambda jpeg: upload_input(jpeg, policy, self.settings.max_image_pixels))
        fail_rows(parts, errors)
        return decoder.join(decoded, host_images)

    async def close(self) -> None:
        await self.models.close()
        for batcher in [*self.batchers.values(), *self.side_batchers.values()]:
            await batcher.stop()
        if self.inference is not None:
            self.inference.shutdown(wait=True, cancel_futures=True)

    # -- serving -------------------------------------------------------------------------------------
    def status(self) -> dict[str, ModelStatus]:
        return self.models.status

    def problem(self) -> Unavailable | None:
        """Why nothing can be served: the device failed every batch for a while (device_health.py)."""
        if self.health.broken is None:
            return None
        return Unavailable(f"{self.health.broken}; this process is stopping for a new one to serve", "device_failed",
                           self.settings.retry_after_s)

    def batcher(self, model: str) -> Batcher:
        """The batcher of the graph that serves `model` (NotFound where none does)."""
        plan = self.models.plans.get(model)
        batcher = self.batchers.get(plan.graph) if plan else None
        if batcher is None:
            raise NotFound(f"{model} is not being served", "model_not_found")
        return batcher

    @contextmanager
    def records(self, model: str, kind: str, n: int) -> Iterator[Lease]:
        yield Lease(np.empty(n, record_dtype(self.models.by_key[model], kind)))

    def preparing(self, model: str) -> AbstractContextManager[None]:
        return self.boards.preparing(self._index(model))

    def gpu_room(self, model: str) -> int:
        return int(self.jpeg_room.counts[self._index(model)])

    def _index(self, model: str) -> int:
        """The model's place on the boards."""
        return next(i for i, e in enumerate(self.entries) if e.key == model)

    def run_here(self, model: str, lease: Lease, top_k: int, trace: str | None = None) -> bool:
        """From a decode thread: the lease's records run in it at once where the model's batcher is idle and runs
        one batch at a time, as on the CPU (Batcher.try_run_here); False, having done nothing, where they must be
        run."""
        return self.batcher(model).try_run_here(lease.records, top_k, trace)

    async def run(self, model: str, lease: Lease, top_k: int, jpegs: list[bytes] | None = None,
                  shared: SharedIO | None = None) -> None:
        """Results written into the lease's records (and into shared memory, where `shared` asks). Cancelled, it
        returns only once nothing writes into them any more."""
        batcher, records = self.batcher(model), lease.records
        claim = None if shared is None else self.regions.claim(shared, records, kind_of(records))
        try:
            try:
                entry = batcher.submit(records, top_k, jpegs if claim is None or claim.inputs is None else claim.inputs,
                                       traces=[tracing.traceparent()], priority=request_priority())
            except QueueFull as e:
                raise overloaded(str(e), self.settings.retry_after_s) from None
            try:
                errors = await entry.future
            except asyncio.CancelledError:
                await batcher.settled(entry)
                raise
            if errors:  # an image that failed alone fails its request
                raise next(iter(errors.values()))
            if claim is not None:
                claim.write(records)
        finally:
            if claim is not None:
                claim.release()

    async def side(self, model: str, name: str, inputs: Batch) -> Batch:
        """`inputs` (a row per item of each of the side graph's input fields: side_graphs.py) run on the model's side
        graph `name` in a batch with other requests' items (the graph's batching policy; overloaded past its queue
        limit) -> its outputs, a row per item."""
        side = SIDE_GRAPHS[name]
        graph = self.models.plans[model].graph
        entry = self.models.by_key[graph]
        if not entry.has(name):
            raise BadInput(side.missing.format(model=model), side.missing_code)
        records = np.empty(len(inputs[side.inputs[0]]), side.record(entry))
        for field in side.inputs:
            records[field] = inputs[field]
        batcher = self.side_batchers.get((graph, name))
        if batcher is None:
            batcher = self.side_batchers[graph, name] = Batcher(
                f"{graph}:{name}", self._run_side(graph, side, list(self.models.plans[model].providers)),
                self.inference, self.metrics, self.models.batching(graph), self.concurrency)
            batcher.start()
        try:
            queued = batcher.submit(records, priority=request_priority())
        except QueueFull as e:
            raise overloaded(str(e), self.settings.retry_after_s) from None
        try:
            await queued.future
        except asyncio.CancelledError:
            await batcher.settled(queued)
            raise
        return {field: records[field].copy() for field in side.outputs}

    def _run_side(self, graph: str, side: SideGraph, providers: list[str]):
        """A batch of a side graph's records: each part's inputs gathered, run, and its outputs written back."""
        models = self.models

        def run(parts: list[Part], queue_ms: list[float]) -> float:
            if (broken := self.problem()) is not None:
                raise broken
            entry = models.by_key[graph]
            session = models.side_sessions.get((graph, side.name))
            if session is None:  # only the inference threads get here; a second open is harmless
                session = models.side_sessions[graph, side.name] = side.open(
                    verify_file(entry, side.name), entry, providers, self.settings)
            start = time.perf_counter()
            scatter(parts, side.run(session, entry, {field: gather(parts, field) for field in side.inputs}))
            return time.perf_counter() - start

        return run

    async def explain(self, model: str, image: np.ndarray) -> list[np.ndarray]:
        models = self.models
        graph = models.plans[model].graph
        entry = models.by_key[graph]
        if not entry.has("explain"):
            raise BadInput(f"{model} has no explain graph; use method=last", "rollout_unavailable")

        def work() -> list[np.ndarray]:
            if graph not in models.explainers:  # only the inference threads get here; a second open is harmless
                models.explainers[graph] = self._explainer(entry, graph, model)
            h, w = entry.policy.size
            outputs = models.explainers[graph].run(image[None], np.zeros((0, 3, h, w), np.float32))
            return [outputs[name][0] for name in entry.manifest["attention"]["explain_outputs"]]

        return await asyncio.get_running_loop().run_in_executor(self.inference, work)

    def _explainer(self, entry: ModelEntry, graph: str, model: str) -> Runner | OpenVinoRunner:
        """The explain graph's runner: on the CPU in the runtime of the plan that runs the model, at its precision
        (fp32 for an int8 plan: the explain graph is not quantized), else as the model's own graph."""
        path, settings, chosen = verify_file(entry, "explain"), self.settings, self.models.cpu_plans.get(graph)
        if chosen is not None:
            precision = "fp32" if chosen.plan.precision == "int8" else chosen.plan.precision
            return open_runner(path, input_names(entry), CpuPlan(chosen.plan.runtime, precision, "explain"),
                               settings.intra_op_threads, settings.spin_wait, settings.iobinding)
        return Runner(path, input_names(entry), list(self.models.plans[model].providers), settings.intra_op_threads,
                      settings.spin_wait, settings.cuda_tf32, iobinding=settings.iobinding)

    # -- shared memory (the inference process's, under the process backend) --------------------------------
    async def register_region(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.regions.register(name, key, offset, byte_size)

    async def unregister_region(self, name: str) -> None:
        self.regions.unregister(name)

    async def region_status(self, name: str) -> list[dict]:
        return self.regions.status(name)

    async def store_attention(self, key: str, result: AttentionResult) -> bool:
        return self.cache.put(key, result)

    async def recall_attention(self, key: str) -> AttentionResult | None:
        return self.cache.get(key)


def fail_rows(parts: list[Part], errors: dict[int, Exception]) -> None:
    """Rows of a batch that failed alone, by their place in the batch (the parts' rows in order), fail their own
    requests (Part.errors)."""
    if not errors:
        return
    owners = [(part, row) for part in parts for row in row_numbers(part.rows)]
    for i, error in errors.items():
        part, row = owners[i]
        part.errors[row] = error
