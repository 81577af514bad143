"""The models of the in-process backend (local.py) and their lifecycle: the first load at start-up, their
readiness, and, while serving, a model (re)loaded, unloaded, or found changed by polling the repository.

A model is (re)loaded while serving by opening and warming its new session beside the old one and then switching
the graph's runner: each batch takes the runner there when it starts, so batches running finish on the old
session, which is let go once they have. An unload refuses new requests and answers those accepted.

LocalBackend holds one ModelLifecycle as `models`: it owns the models' state (entries, by_key, plans, runners,
status, problems, generation), which the backend's batches read, and asks the backend (`Graphs`) to start, settle
and stop the batching of a graph.
"""
import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from contextlib import suppress
from typing import Protocol

import numpy as np

from repository import ModelEntry, find_entries, model_manifests, servable
from service.core.errors import BadInput, NotFound, ServiceError
from service.core.memory import release_memory
from service.core.metrics import Metrics
from service.core.settings import Settings

from ..batching import BatchingPolicy
from ..heads import HEADS
from ..records import KINDS, Kind, record_dtype
from ..cpu_plans import Choice, choose
from ..openvino_runtime import OpenVinoRunner
from ..runtime import CPU, CUDA, Plan, Runner, serving_plan
from . import DecodeOn, ModelStatus

log = logging.getLogger("vitserve")


class Graphs(Protocol):
    """What the lifecycle asks of the backend that batches its graphs' requests (LocalBackend)."""

    inference: Executor  # the inference threads: sessions open there at start-up, before any batch runs

    def serve_graph(self, graph: str) -> None:
        """Batch the graph's requests from now on, by its entry's batching (its runner is in ModelLifecycle.runners)."""

    def rebatch_graph(self, graph: str) -> None:
        """The graph reloaded: its batches from now on follow its entry's batching as it is now."""

    async def graph_settled(self, graph: str) -> None:
        """Every batch of the graph started so far has ended."""

    async def close_graph(self, graph: str) -> None:
        """Once nothing is queued, running or on its way for the graph, stop batching it."""


async def _at_once(generation: int) -> None:
    pass


def chosen_status(chosen: Choice) -> dict:
    """What a model's status says of the CPU plan it runs (ModelStatus.plan...)."""
    reason = chosen.reason + ("" if chosen.plan.batch_invariant else "; its images run one at a time (dynamic int8 "
                              "quantizes a batch with one scale: each image is answered as alone)")
    return {"plan": chosen.plan.name, "plan_reason": reason, "plan_measured": chosen.measured or None}


def no_head(entry: ModelEntry) -> str:
    return f"its task {entry.task!r} has no head in this server (service/engine/heads.py)"


class ModelLifecycle:
    def __init__(self, settings: Settings, metrics: Metrics, graphs: Graphs, on_status: Callable[[], None]):
        """The repository's models, read at once (a missing repository fails here); `on_status`: called on every
        status change."""
        self.settings, self.metrics, self.graphs, self.on_status = settings, metrics, graphs, on_status
        entries, self.problems = servable(settings.model_repository)  # folders that cannot be served, with why
        self.problems |= {e.location: no_head(e) for e in entries if e.task not in HEADS}
        entries = [e for e in entries if e.task in HEADS]
        for name, problem in self.problems.items():
            log.error("not serving %s: %s", name, problem)
        self.entries: list[ModelEntry] = entries
        self.by_key = {e.key: e for e in entries}  # a model version's key: NAME or NAME@VERSION
        self.plans: dict[str, Plan] = {}
        self.status = {e.key: ModelStatus() for e in entries}
        self.runners: dict[str, Runner] = {}  # by graph
        self.explainers: dict[str, Runner] = {}  # by graph, opened on first use (LocalBackend.explain)
        # by (graph, side graph's name): the side graphs' sessions (side_graphs.py), opened on first use
        self.side_sessions: dict[tuple[str, str], object] = {}
        self.cpu_plans: dict[str, Choice | None] = {}  # by graph: the plan chosen on the CPU (None on CUDA)
        self.jpeg_decoders: dict[str, object] = {}  # by graph: GPU JPEG decoders (gpu_decode.py), where they work
        self.decode_reasons: dict[str, str] = {}  # by graph: why its GPU decoder did not start (ModelStatus)
        self.device = CPU
        self.generation = 0  # counts status changes
        self.max_models: int | None = None  # under the process backend, the workers' boards have this many slots
        # returns once every process that routes requests here has seen status `generation` (the process backend's
        # workers acknowledge each push; in this process a change is seen at once)
        self.seen_everywhere: Callable[[int], Awaitable[None]] = _at_once
        self._info_labels: dict[str, tuple[str, ...]] = {}
        self._lock = asyncio.Lock()  # one load or unload at a time
        self._loading: asyncio.Task | None = None
        self._polling: asyncio.Task | None = None

    def start(self, device: str) -> None:
        """Plan every model on the device chosen, then open them in the background (and poll the repository where
        VITSERVE_MODEL_CONTROL=poll)."""
        loop = asyncio.get_running_loop()
        self.device = device
        self.plans = serving_plan(self.entries, device, self.settings.providers)
        self._loading = loop.create_task(self._load_all(), name="load-models")
        if self.settings.model_control == "poll":
            self._polling = loop.create_task(self._poll(), name="poll-repository")

    async def close(self) -> None:
        for task in (self._loading, self._polling):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def use_jpeg_decoder(self, graph: str, decoder) -> None:
        """JPEGs for this graph's models are sent undecoded and decoded with their batch by `decoder`
        (gpu_decode.GpuDecoder's interface)."""
        self.jpeg_decoders[graph] = decoder
        for name, plan in self.plans.items():
            if plan.graph == graph and self.status[name].ready:
                self.status[name].decode, self.status[name].decode_reason = DecodeOn.GPU, None
        self._changed()

    async def loaded(self) -> None:
        await asyncio.shield(self._loading)

    async def _load_all(self) -> None:
        loop, threads = asyncio.get_running_loop(), self.graphs.inference
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
                self.runners[graph], chosen = await loop.run_in_executor(threads, self._open, self.by_key[graph],
                                                                         plan)
            except Exception as e:  # one broken model must not keep the others from serving
                for name in names[graph]:
                    self._fail(name, getattr(e, "message", str(e)))
            else:
                self.cpu_plans[graph] = chosen
                self.metrics.load_seconds.labels(self.by_key[graph].name).observe(time.perf_counter() - start)
        for graph, runner in self.runners.items():
            if runner.provider == CUDA and self.settings.gpu_decode:
                from service.images.gpu_decode import gpu_decoder  # CuPy and nvImageCodec stay unimported on a CPU host
                decoder, reason = await loop.run_in_executor(
                    threads, gpu_decoder, self.by_key[graph].policy, graph, self.batching(graph).max_batch_size)
                if decoder is not None:
                    self.use_jpeg_decoder(graph, decoder)
                else:
                    self.decode_reasons[graph] = reason
            self.graphs.serve_graph(graph)
            for name in names[graph]:
                self._ready(name, runner.provider)

    def batching(self, graph: str, entry: ModelEntry | None = None) -> BatchingPolicy:
        """How the graph's batches are made (BatchingPolicy.of): `entry` (the graph's, by default the one serving
        now), with the model it runs for where that is another (an fp16 sibling's fp32 model)."""
        model = next((self.by_key[p.name] for p in self.plans.values() if p.graph == graph and p.name != graph), None)
        return BatchingPolicy.of(self.settings, entry or self.by_key[graph], model)

    def _open(self, entry: ModelEntry, plan: Plan, serving: bool = False) -> tuple[Runner | OpenVinoRunner,
                                                                                  Choice | None]:
        """The graph's runner, warmed up; on the CPU, in the plan of its export's that cpu_plans chose (with how):
        measured only where nothing `serving` yet (start-up), never beside live batches."""
        settings, batches = self.settings, sorted({1, self.batching(plan.graph, entry).max_batch_size})
        chosen = None
        if plan.provider == CPU:
            chosen = choose(entry, input_names(entry), batches, settings.cpu_plan, settings.intra_op_threads,
                            settings.spin_wait, settings.iobinding, settings.cpu_plan_dir, measure_now=not serving)
            runner = chosen.runner
            log.info("%s runs on %s: %s%s", entry.key, chosen.plan.name, chosen.reason,
                     f" {chosen.measured} images/s" if chosen.measured else "")
        else:
            runner = Runner(entry.path(), input_names(entry), list(plan.providers), settings.intra_op_threads,
                            settings.spin_wait, settings.cuda_tf32, settings.cuda_graph_max_batch, settings.iobinding)
        # first runs allocate memory and pick kernels: do them before the first request does
        h, w = entry.policy.size
        start, no_tensors = time.perf_counter(), np.zeros((0, 3, h, w), np.float32)
        for batch in batches:
            images = runner.host_batch(batch)  # sizes this thread's batch buffer too
            images[:] = 0
            for _ in range(self.settings.warmup_runs):
                runner.run(images, no_tensors)
        log.debug("%s warmed up in %.2fs", entry.key, time.perf_counter() - start)
        return runner, chosen

    def _ready(self, name: str, provider: str, loads: int = 1) -> None:
        plan, entry = self.plans[name], self.by_key[name]
        decode_on = DecodeOn.GPU if plan.graph in self.jpeg_decoders else DecodeOn.CPU
        reason = None
        if decode_on == DecodeOn.CPU and provider == CUDA and self.settings.gpu_decode:  # wanted and not there: why
            reason = self.decode_reasons.get(plan.graph, "GPU decoding is set up at start-up only, and this graph "
                                                         "was loaded later")
        chosen = self.cpu_plans.get(plan.graph)
        precision = chosen.plan.precision if chosen else plan.precision
        self.status[name] = ModelStatus(True, None, provider, precision, plan.graph, decode_on, reason, loads=loads,
                                        **(chosen_status(chosen) if chosen else {}))
        self.metrics.ready.labels(name).set(1)
        self.metrics.loads.labels(entry.name, "ok").inc()
        self._info(name, (entry.name, str(entry.version), entry.manifest["architecture"], entry.task, precision,
                          provider))
        log.info("%s ready on %s (%s, %s%s)", name, provider, entry.manifest["architecture"], precision,
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
        self.status[name] = ModelStatus(False, error)
        self.metrics.loads.labels(self.by_key[name].name, "failed").inc()
        log.error("not serving %s: %s", name, error)
        self._changed()

    # -- while serving ---------------------------------------------------------------------------------
    async def load(self, model: str) -> None:
        """Every version of the model that its folder's policy serves: one not serving opens and warms up beside
        what serves (then new requests go to the latest), one re-exported in place is switched to between
        batches, and versions the policy no longer names are unloaded once the new ones serve."""
        loop = asyncio.get_running_loop()
        await asyncio.shield(self._loading)  # start-up's loads first
        async with self._lock:
            log.info("%s loading from %s", model, self.settings.model_repository)
            start = time.perf_counter()
            try:
                entries = await loop.run_in_executor(None, find_entries, self.settings.model_repository, model)
                changed = [e for e in entries if e.key not in self.status or not self.status[e.key].ready
                           or self.by_key[e.key].manifest != e.manifest]
                plans = {e.key: self._reload_plan(e) for e in changed}
                runners = {}
                for entry in changed:  # off the inference thread: batches go on meanwhile
                    runners[entry.key] = await loop.run_in_executor(None, self._open, entry, plans[entry.key],
                                                                    True)
            except Exception as e:  # the repository's, the plan's or ONNX Runtime's (its own exception types)
                raise self._load_failed(model, getattr(e, "message", str(e))) from None
            self.metrics.load_seconds.labels(model).observe(time.perf_counter() - start)
            replaced = [self.runners.get(plans[e.key].graph) for e in changed]
            for entry in changed:
                self._switch(entry, plans[entry.key], *runners[entry.key])
            for entry in changed:  # batches that took a replaced runner finish before it is let go
                await self.graphs.graph_settled(plans[entry.key].graph)
            if any(runner is not None for runner in replaced):
                del replaced
                release_memory()
            serving = {e.key for e in entries}
            for key, entry in list(self.by_key.items()):
                if entry.name == model and key not in serving and not self.status[key].unloaded:
                    await self._unload(key)

    def _reload_plan(self, entry: ModelEntry) -> Plan:
        """What serves the entry once loaded: its own graph. BadInput where it cannot be switched to while serving."""
        plan = serving_plan([entry], self.device, self.settings.providers)[entry.key]
        old = self.by_key.get(entry.key)
        if plan.error:
            raise BadInput(plan.error)
        if entry.task not in HEADS:
            raise BadInput(no_head(entry))
        if old is None and self.max_models is not None and len(self.entries) >= self.max_models:
            raise BadInput(f"{entry.key} would be model number {len(self.entries) + 1}; this server serves at most "
                           f"{self.max_models}")
        if old is not None and any(record_dtype(old, k) != record_dtype(entry, k) for k in KINDS if k != Kind.JPEG):
            raise BadInput(f"{entry.location}: re-exported in place with another input size or outputs, which the "
                           "requests under way cannot take: export it as a new version (--version next)")
        return plan

    def _load_failed(self, model: str, reason: str) -> BadInput:
        """Recorded for the index (beside what still serves), counted and logged."""
        keys = [key for key, entry in self.by_key.items() if entry.name == model]
        for key in keys:  # what served (if anything) goes on serving
            self.status[key] = dataclasses.replace(self.status[key], last_failure=reason)
        if not keys:
            self.problems[model] = reason
        self.metrics.loads.labels(model, "failed").inc()
        serving = any(self.status[key].ready for key in keys)
        log.error("%s failed to load: %s%s", model, reason, "; what served still serves" if serving else "")
        self._changed()
        return BadInput(f"{model} failed to load: {reason}", "load_failed")

    def _switch(self, entry: ModelEntry, plan: Plan, runner: Runner | OpenVinoRunner, chosen: Choice | None
                ) -> None:
        """Batches that start from now on run the entry's new session."""
        key, graph = entry.key, plan.graph
        new_graph = graph not in self.runners
        self.runners[graph], self.cpu_plans[graph] = runner, chosen
        self._close_side_graphs(graph)
        if key in self.by_key:
            self.entries[self.entries.index(self.by_key[key])] = entry
        else:
            self.entries.append(entry)  # last: the workers' boards keep their order
        self.by_key[key], self.plans[key] = entry, plan
        model_folder = entry.location.split("/")[0]  # its problems, any version's, are solved
        for where in [w for w in self.problems if w.split("/")[0] == model_folder]:
            del self.problems[where]
        if new_graph:
            self.graphs.serve_graph(graph)
        else:
            self.graphs.rebatch_graph(graph)
        self._ready(key, runner.provider, self.status[key].loads + 1 if key in self.status else 1)

    def _close_side_graphs(self, graph: str) -> None:
        """The graph's explain and side sessions dropped: the next use opens its new version's."""
        self.explainers.pop(graph, None)
        for key in [key for key in self.side_sessions if key[0] == graph]:
            del self.side_sessions[key]

    async def unload(self, model: str) -> None:
        await asyncio.shield(self._loading)
        async with self._lock:
            keys = [key for key, entry in self.by_key.items() if entry.name == model and not self.status[key].unloaded]
            if not keys:
                raise NotFound(f"{model} is not being served", "model_not_found")
            for key in keys:
                await self._unload(key)

    async def _unload(self, key: str) -> None:
        """New requests are turned away at once (NotFound); the session closes once those accepted are answered."""
        self.status[key] = ModelStatus(unloaded=True, loads=self.status[key].loads)
        self.metrics.ready.labels(key).set(0)
        self._info(key, None)
        log.info("%s unloading: answering the requests it accepted", key)
        self._changed()
        await self.seen_everywhere(self.generation)  # from then on no request is routed to it: drain what was
        graph = self.plans[key].graph
        if graph in self.runners and not any(p.graph == graph and self.status[k].ready
                                             for k, p in self.plans.items()):
            await self.graphs.close_graph(graph)
            self.runners.pop(graph, None)
            self._close_side_graphs(graph)
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
        for key, s in sorted(self.status.items()):
            state = "READY" if s.ready else "UNAVAILABLE" if s.error or s.unloaded else "LOADING"
            reason = "; ".join(why for why in (s.error, "unloaded" if s.unloaded else None,
                                               s.last_failure and f"the last load failed: {s.last_failure}") if why)
            entry = self.by_key[key]
            rows.append({"name": entry.name, "version": str(entry.version), "state": state, "reason": reason})
        rows += [{"name": folder, "state": "UNAVAILABLE", "reason": why} for folder, why in self.problems.items()
                 if folder not in self.status]
        return rows


def input_names(entry: ModelEntry) -> tuple[str, str]:
    return entry.manifest["input"]["name"], entry.manifest["tensor_input"]["name"]
