"""The in-process backend: ONNX Runtime sessions, one dynamic batcher per graph, batches in an inference thread.

Start-up reads the repository at once (a broken repository fails start-up); the device is chosen once, then
sessions open and warm up in the background, so /health/live answers at once and /health/ready turns 200
when every model is warm. The inference server of the process backend is this backend behind a socket.

A model is (re)loaded while serving by opening and warming its new session beside the old one and then
switching the graph's runner: each batch takes the runner there when it starts, so batches running finish on
the old session, which is let go once they have. An unload refuses new requests and answers those accepted.
"""
import asyncio
import ctypes
import dataclasses
import gc
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext, suppress
from functools import partial

import numpy as np

from repository import ModelEntry, find_entries, model_manifests, servable, verify_file

from ..batching import Batcher, QueueFull
from ..cache import AttentionCache, AttentionRecord
from ..decode import upload_input
from ..errors import BadInput, NotFound, ServiceError, overloaded
from ..metrics import Metrics
from ..records import KINDS, Part, host_inputs, record_dtype, row_numbers, spans, write_results
from ..runtime import CPU, CUDA, Plan, Runner, choose_device, serving_plan
from ..settings import Settings
from . import ModelStatus

log = logging.getLogger("vitserve")


class LocalBackend:
    def __init__(self, settings: Settings, metrics: Metrics, on_status: Callable[[], None] = lambda: None):
        self.settings, self.metrics, self.on_status = settings, metrics, on_status
        entries, self.problems = servable(settings.model_repository)  # a missing repository fails here
        for name, problem in self.problems.items():
            log.error("not serving %s: %s", name, problem)
        self.entries: list[ModelEntry] = entries
        self.by_key = {e.key: e for e in entries}  # a model version's key: NAME or NAME@VERSION
        self.plans: dict[str, Plan] = {}
        self._status = {e.key: ModelStatus() for e in entries}
        self.runners: dict[str, Runner] = {}  # by graph
        self.batchers: dict[str, Batcher] = {}  # by graph
        self._explainers: dict[str, Runner] = {}  # by graph, opened on first use
        self.jpeg_decoders: dict[str, object] = {}  # by graph: GPU JPEG decoders (gpu_decode.py), where they work
        self.decode_reasons: dict[str, str] = {}  # by graph: why its GPU decoder did not start (ModelStatus)
        self.cache = AttentionCache(settings.attention_cache_items, settings.attention_cache_bytes,
                                    settings.attention_ttl_s)
        self.inference: ThreadPoolExecutor | None = None
        self.concurrency = 1  # batches in flight per graph, decided with the device
        # other processes' requests decoding for each model (entries' order), in their shared memory: the HTTP
        # workers' boards under the process backend
        self.boards: list[np.ndarray] = []
        self._loading: asyncio.Task | None = None
        self.device = CPU
        self._info_labels: dict[str, tuple[str, ...]] = {}
        self.max_models: int | None = None  # under the process backend, the workers' boards have this many slots
        self._lifecycle = asyncio.Lock()  # one load or unload at a time
        self.generation = 0  # counts status changes
        # returns once every process that routes requests here has seen status `generation` (the process backend's
        # workers acknowledge each push; in this process a change is seen at once)
        self.seen_everywhere: Callable[[int], Awaitable[None]] = _at_once
        self._polling: asyncio.Task | None = None

    # -- start-up ------------------------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.device = await loop.run_in_executor(None, choose_device, self.entries, self.settings.providers)
        self.plans = serving_plan(self.entries, self.device, self.settings.providers)
        # One inference thread on a CPU (each batch already uses every core); two on a GPU, so that one
        # batch is copied in and post-processed while the other computes.
        self.concurrency = 2 if self.device == CUDA else 1
        self.inference = ThreadPoolExecutor(self.concurrency, thread_name_prefix="inference")
        self._loading = loop.create_task(self._load_all(), name="load-models")
        if self.settings.model_control == "poll":
            self._polling = loop.create_task(self._poll(), name="poll-repository")

    async def loaded(self) -> None:
        await asyncio.shield(self._loading)

    async def _load_all(self) -> None:
        loop = asyncio.get_running_loop()
        for plan in self.plans.values():
            if plan.error:
                self._fail(plan.name, plan.error)
        graphs = {p.graph: p for p in self.plans.values() if not p.error}
        names = {graph: [p.name for p in self.plans.values() if p.graph == graph and not p.error] for graph in graphs}
        # Every graph opens (and captures its CUDA graphs) before any batch runs: CUDA's global capture mode, the
        # one ONNX Runtime uses, fails a capture while another thread works on the GPU.
        for graph, plan in graphs.items():
            start = time.perf_counter()
            try:
                self.runners[graph] = await loop.run_in_executor(self.inference, self._open, self.by_key[graph], plan)
            except Exception as e:  # one broken model must not keep the others from serving
                for name in names[graph]:
                    self._fail(name, str(e))
            else:
                self.metrics.load_seconds.labels(self.by_key[graph].name).observe(time.perf_counter() - start)
        for graph, runner in self.runners.items():
            if runner.provider == CUDA and self.settings.gpu_decode:
                from ..gpu_decode import gpu_decoder  # CuPy and nvImageCodec stay unimported on a CPU host
                decoder, reason = await loop.run_in_executor(self.inference, gpu_decoder, self.by_key[graph].policy,
                                                             graph)
                if decoder is not None:
                    self.use_jpeg_decoder(graph, decoder)
                else:
                    self.decode_reasons[graph] = reason
            self._start_batcher(graph)
            for name in names[graph]:
                self._ready(name, runner.provider)

    def _start_batcher(self, graph: str) -> None:
        self.batchers[graph] = Batcher(
            graph, self._run_batch(graph), self.inference, self.metrics, self.settings.max_batch_size,
            self.settings.max_queue_delay_ms / 1000, self.settings.queue_limit, self.concurrency)
        models = [i for i, e in enumerate(self.entries) if self.plans[e.key].graph == graph]
        self.batchers[graph].elsewhere = partial(self._preparing_elsewhere, models)
        self.batchers[graph].start()

    def _open(self, entry: ModelEntry, plan: Plan) -> Runner:
        runner = Runner(entry.path(), _input_names(entry), list(plan.providers), self.settings.intra_op_threads,
                        self.settings.spin_wait, self.settings.cuda_tf32, self.settings.cuda_graph_max_batch,
                        self.settings.iobinding)
        # first runs allocate memory and pick kernels: do them before the first request does
        h, w = entry.policy.size
        start, no_tensors = time.perf_counter(), np.zeros((0, 3, h, w), np.float32)
        for batch in sorted({1, self.settings.max_batch_size}):
            images = runner.host_batch(batch)  # sizes this thread's batch buffer too
            images[:] = 0
            for _ in range(self.settings.warmup_runs):
                runner.run(images, no_tensors)
        log.debug("%s warmed up in %.2fs", entry.key, time.perf_counter() - start)
        return runner

    def use_jpeg_decoder(self, graph: str, decoder) -> None:
        """JPEGs for this graph's models are sent undecoded and decoded with their batch by `decoder`
        (gpu_decode.GpuDecoder's interface)."""
        self.jpeg_decoders[graph] = decoder
        for name, plan in self.plans.items():
            if plan.graph == graph and self._status[name].ready:
                self._status[name].decode, self._status[name].decode_reason = "gpu", None
        self._changed()

    def _ready(self, name: str, provider: str, loads: int = 1) -> None:
        plan, entry = self.plans[name], self.by_key[name]
        decode_on = "gpu" if plan.graph in self.jpeg_decoders else "cpu"
        reason = None
        if decode_on == "cpu" and provider == CUDA and self.settings.gpu_decode:  # wanted, and not there: say why
            reason = self.decode_reasons.get(plan.graph, "GPU decoding is set up at start-up only, and this graph "
                                                         "was loaded later")
        self._status[name] = ModelStatus(True, None, provider, plan.precision, plan.graph, decode_on, reason,
                                         loads=loads)
        self.metrics.ready.labels(name).set(1)
        self.metrics.loads.labels(entry.name, "ok").inc()
        self._info(name, (entry.name, str(entry.version), entry.manifest["architecture"], entry.task, plan.precision,
                          provider))
        log.info("%s ready on %s (%s, %s%s)", name, provider, entry.manifest["architecture"], plan.precision,
                 "" if plan.graph == name else f", the graph of {plan.graph}")
        self._changed()

    def _changed(self) -> None:
        self.generation += 1
        self.on_status()

    def _info(self, name: str, labels: tuple[str, ...] | None) -> None:
        """vitserve_model_info's one series for the model: what serves it now, if anything."""
        if (old := self._info_labels.pop(name, None)) is not None:
            self.metrics.model_info.remove(*old)
        if labels is not None:
            self.metrics.model_info.labels(*labels).set(1)
            self._info_labels[name] = labels

    def _fail(self, name: str, error: str) -> None:
        self._status[name] = ModelStatus(False, error)
        self.metrics.loads.labels(self.by_key[name].name, "failed").inc()
        log.error("not serving %s: %s", name, error)
        self._changed()

    def _run_batch(self, graph: str):
        policy = self.by_key[graph].policy  # a reload keeps the records' layout, the input size with it

        def run(parts: list[Part], queue_ms: list[float]) -> float:
            runner = self.runners[graph]  # taken per batch: a reload switches it between batches
            batch = spans(parts)
            images, tensors = host_inputs(batch, policy.size, runner.host_batch)
            if jpegs := [p for p in parts if p.kind == "jpeg"]:
                images = self._decode_jpegs(graph, jpegs, images)
            start = time.perf_counter()
            outputs = runner.run(images, tensors)
            elapsed = time.perf_counter() - start
            write_results(batch, outputs, queue_ms, elapsed * 1e3)
            return elapsed

        return run

    def _decode_jpegs(self, graph: str, parts: list[Part], host_images: np.ndarray):
        """The "jpeg" parts decoded on the GPU, followed by the host images: the batch's images, on the device. A
        JPEG that neither nvImageCodec nor Pillow can read fails its own request only."""
        decoder, policy = self.jpeg_decoders[graph], self.by_key[graph].policy
        jpegs = [data for part in parts for data in part.jpegs]
        owners = [(part, row) for part in parts for row in row_numbers(part.rows)]
        decoded, errors = decoder.decode(jpegs, lambda jpeg: upload_input(jpeg, policy, self.settings.max_image_pixels))
        for i, error in errors.items():
            part, row = owners[i]
            part.errors[row] = error
        return decoder.join(decoded, host_images)

    async def close(self) -> None:
        for task in (self._loading, self._polling):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for batcher in self.batchers.values():
            await batcher.stop()
        if self.inference is not None:
            self.inference.shutdown(wait=True, cancel_futures=True)

    # -- serving -------------------------------------------------------------------------------------
    def status(self) -> dict[str, ModelStatus]:
        return self._status

    def batcher(self, model: str) -> Batcher:
        """The batcher of the graph that serves `model` (NotFound where none does)."""
        plan = self.plans.get(model)
        batcher = self.batchers.get(plan.graph) if plan else None
        if batcher is None:
            raise NotFound(f"{model} is not being served", "model_not_found")
        return batcher

    @contextmanager
    def records(self, model: str, kind: str, n: int) -> Iterator[np.ndarray]:
        yield np.empty(n, record_dtype(self.by_key[model], kind))

    def preparing(self, model: str):
        batcher = self.batchers.get(self.plans[model].graph) if model in self.plans else None
        return batcher.preparing() if batcher is not None else nullcontext()

    def _preparing_elsewhere(self, models: list[int]) -> int:
        return sum(int(board[i]) for board in self.boards for i in models)

    def run_here(self, model: str, records: np.ndarray, top_k: int) -> bool:
        """From a decode thread: the records run in it at once where the model's batcher is idle and runs one batch
        at a time, as on the CPU (Batcher.try_run_here); False, having done nothing, where they must be run."""
        return self.batcher(model).try_run_here(records, top_k)

    async def run(self, model: str, records: np.ndarray, top_k: int, jpegs: list[bytes] | None = None) -> None:
        """Results written into `records`. Cancelled, it returns only once nothing writes into them any more."""
        batcher = self.batcher(model)
        try:
            entry = batcher.submit(records, top_k, jpegs)
        except QueueFull as e:
            raise overloaded(str(e), self.settings.retry_after_s) from None
        try:
            errors = await entry.future
        except asyncio.CancelledError:
            await batcher.settled()
            raise
        if errors:  # an image that failed alone fails its request
            raise next(iter(errors.values()))

    async def explain(self, model: str, image: np.ndarray) -> list[np.ndarray]:
        graph = self.plans[model].graph
        entry = self.by_key[graph]
        if not entry.has("explain"):
            raise BadInput(f"{model} has no explain graph; use method=last", "rollout_unavailable")

        def work() -> list[np.ndarray]:
            if graph not in self._explainers:  # only the inference threads get here; a second open is harmless
                self._explainers[graph] = Runner(verify_file(entry, "explain"), _input_names(entry),
                                                 list(self.plans[model].providers), self.settings.intra_op_threads,
                                                 self.settings.spin_wait, self.settings.cuda_tf32,
                                                 iobinding=self.settings.iobinding)
            h, w = entry.policy.size
            outputs = self._explainers[graph].run(image[None], np.zeros((0, 3, h, w), np.float32))
            return [outputs[name][0] for name in entry.manifest["attention"]["explain_outputs"]]

        return await asyncio.get_running_loop().run_in_executor(self.inference, work)

    # -- the model lifecycle ----------------------------------------------------------------------------
    async def load(self, model: str) -> None:
        """Every version of the model that its folder's policy serves: one not serving opens and warms up beside
        what serves (then new requests go to the latest), one re-exported in place is switched to between
        batches, and versions the policy no longer names are unloaded once the new ones serve."""
        loop = asyncio.get_running_loop()
        await asyncio.shield(self._loading)  # start-up's loads first
        async with self._lifecycle:
            log.info("%s loading from %s", model, self.settings.model_repository)
            start = time.perf_counter()
            try:
                entries = await loop.run_in_executor(None, find_entries, self.settings.model_repository, model)
                changed = [e for e in entries if e.key not in self._status or not self._status[e.key].ready
                           or self.by_key[e.key].manifest != e.manifest]
                plans = {e.key: self._reload_plan(e) for e in changed}
                runners = {}
                for entry in changed:  # off the inference thread: batches go on meanwhile
                    runners[entry.key] = await loop.run_in_executor(None, self._open, entry, plans[entry.key])
            except Exception as e:  # the repository's, the plan's or ONNX Runtime's (its own exception types)
                raise self._load_failed(model, getattr(e, "message", str(e))) from None
            self.metrics.load_seconds.labels(model).observe(time.perf_counter() - start)
            replaced = [self.runners.get(plans[e.key].graph) for e in changed]
            for entry in changed:
                self._switch(entry, plans[entry.key], runners[entry.key])
            for entry in changed:  # batches that took a replaced runner finish before it is let go
                await self.batchers[plans[entry.key].graph].settled()
            if any(runner is not None for runner in replaced):
                del replaced
                release_memory()
            serving = {e.key for e in entries}
            for key, entry in list(self.by_key.items()):
                if entry.name == model and key not in serving and not self._status[key].unloaded:
                    await self._unload(key)

    def _reload_plan(self, entry: ModelEntry) -> Plan:
        """What serves the entry once loaded: its own graph. BadInput where it cannot be switched to while serving."""
        plan = serving_plan([entry], self.device, self.settings.providers)[entry.key]
        old = self.by_key.get(entry.key)
        if plan.error:
            raise BadInput(plan.error)
        if old is None and self.max_models is not None and len(self.entries) >= self.max_models:
            raise BadInput(f"{entry.key} would be model number {len(self.entries) + 1}; this server serves at most "
                           f"{self.max_models}")
        if old is not None and any(record_dtype(old, k) != record_dtype(entry, k) for k in KINDS if k != "jpeg"):
            raise BadInput(f"{entry.location}: re-exported in place with another input size or outputs, which the "
                           "requests under way cannot take: export it as a new version (--version next)")
        return plan

    def _load_failed(self, model: str, reason: str) -> BadInput:
        """Recorded for the index (beside what still serves), counted and logged."""
        keys = [key for key, entry in self.by_key.items() if entry.name == model]
        for key in keys:  # what served (if anything) goes on serving
            self._status[key] = dataclasses.replace(self._status[key], last_failure=reason)
        if not keys:
            self.problems[model] = reason
        self.metrics.loads.labels(model, "failed").inc()
        serving = any(self._status[key].ready for key in keys)
        log.error("%s failed to load: %s%s", model, reason, "; what served still serves" if serving else "")
        self._changed()
        return BadInput(f"{model} failed to load: {reason}", "load_failed")

    def _switch(self, entry: ModelEntry, plan: Plan, runner: Runner) -> None:
        """Batches that start from now on run the entry's new session."""
        key, graph = entry.key, plan.graph
        self.runners[graph] = runner
        self._explainers.pop(graph, None)
        if key in self.by_key:
            self.entries[self.entries.index(self.by_key[key])] = entry
        else:
            self.entries.append(entry)  # last: the workers' boards keep their order
        self.by_key[key], self.plans[key] = entry, plan
        model_folder = entry.location.split("/")[0]  # its problems, any version's, are solved
        for where in [w for w in self.problems if w.split("/")[0] == model_folder]:
            del self.problems[where]
        if graph not in self.batchers:
            self._start_batcher(graph)
        self._ready(key, runner.provider, self._status[key].loads + 1 if key in self._status else 1)

    async def unload(self, model: str) -> None:
        await asyncio.shield(self._loading)
        async with self._lifecycle:
            keys = [key for key, entry in self.by_key.items() if entry.name == model and not self._status[key].unloaded]
            if not keys:
                raise NotFound(f"{model} is not being served", "model_not_found")
            for key in keys:
                await self._unload(key)

    async def _unload(self, key: str) -> None:
        """New requests are turned away at once (NotFound); the session closes once those accepted are answered."""
        self._status[key] = ModelStatus(unloaded=True, loads=self._status[key].loads)
        self.metrics.ready.labels(key).set(0)
        self._info(key, None)
        log.info("%s unloading: answering the requests it accepted", key)
        self._changed()
        await self.seen_everywhere(self.generation)  # from then on no request is routed to it: drain what was
        graph = self.plans[key].graph
        if graph in self.batchers and not any(p.graph == graph and self._status[k].ready
                                              for k, p in self.plans.items()):
            await self.batchers[graph].drained()
            await self.batchers.pop(graph).stop()
            self.runners.pop(graph, None)
            self._explainers.pop(graph, None)
            release_memory()
        log.info("%s unloaded", key)

    async def _poll(self) -> None:
        """VITSERVE_MODEL_CONTROL=poll: every POLL_S seconds, a model whose serving manifests changed (a new
        export, a new version, a new policy) is loaded again, a new one loaded, and one whose folder has gone
        unloaded. Each change is tried once; a failure is in the index and the log."""
        await asyncio.shield(self._loading)
        seen: dict[str, list[dict]] = {}
        for entry in sorted(self.entries, key=lambda e: e.version):
            seen.setdefault(entry.name, []).append(entry.manifest)
        while True:
            await asyncio.sleep(self.settings.poll_s)
            found = await asyncio.get_running_loop().run_in_executor(None, model_manifests,
                                                                     self.settings.model_repository)
            for name, manifests in found.items():
                if seen.get(name) != manifests:
                    seen[name] = manifests
                    with suppress(ServiceError):
                        await self.load(name)
            for name in [name for name in seen if name not in found]:
                del seen[name]
                with suppress(ServiceError):
                    await self.unload(name)

    async def index(self) -> list[dict]:
        rows = []
        for key, s in sorted(self._status.items()):
            state = "READY" if s.ready else "UNAVAILABLE" if s.error or s.unloaded else "LOADING"
            reason = "; ".join(why for why in (s.error, "unloaded" if s.unloaded else None,
                                               s.last_failure and f"the last load failed: {s.last_failure}") if why)
            entry = self.by_key[key]
            rows.append({"name": entry.name, "version": str(entry.version), "state": state, "reason": reason})
        rows += [{"name": folder, "state": "UNAVAILABLE", "reason": why} for folder, why in self.problems.items()
                 if folder not in self._status]
        return rows

    async def keep(self, key: str, record: AttentionRecord) -> bool:
        return self.cache.put(key, record)

    async def recall(self, key: str) -> AttentionRecord | None:
        return self.cache.get(key)


async def _at_once(generation: int) -> None:
    pass


def release_memory() -> None:
    """A released session's memory back to the system: glibc keeps freed heap for reuse otherwise, and a reload's
    RSS would not come down (no-op on another libc)."""
    gc.collect()
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _input_names(entry: ModelEntry) -> tuple[str, str]:
    return entry.manifest["input"]["name"], entry.manifest["tensor_input"]["name"]
