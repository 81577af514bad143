"""The served models: one ONNX Runtime session and one batcher each, loaded and warmed in the background.

Start-up reads the repository at once (a broken repository fails start-up); sessions open and warm up
after the server is listening, so /health/live answers at once and /health/ready turns 200 when every
model is warm. On a host where CUDA works, a model `NAME` with an fp16 sibling `NAME-fp16` runs that
graph; fp16 graphs are not served on the CPU.
"""
import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .batching import Batcher, QueueFull, Result
from .errors import APIError, overloaded
from .metrics import Metrics
from .preprocess import prepare
from .repository import ModelEntry, RepositoryError, scan, verify_file
from .runtime import CPU, CUDA, Runner
from .settings import Settings

log = logging.getLogger("vitserve")


@dataclass
class ServedModel:
    entry: ModelEntry
    runner: Runner | None = None
    batcher: Batcher | None = None
    explainer: Runner | None = None  # explain.onnx, opened on first use
    ready: bool = False
    error: str | None = None

    @property
    def name(self) -> str:
        return self.entry.name


class ModelPool:
    def __init__(self, settings: Settings, metrics: Metrics):
        self.settings, self.metrics = settings, metrics
        self.models: dict[str, ServedModel] = {}
        self.problems: dict[str, str] = {}
        cores = os.cpu_count() or 1
        # One inference thread: on a CPU host each batch already uses every core, and batches of different
        # models would only fight over them.
        self.inference = ThreadPoolExecutor(1, thread_name_prefix="inference")
        self.decode = ThreadPoolExecutor(settings.decode_threads or min(8, cores), thread_name_prefix="decode")
        self.default_model: str | None = None
        self._loading: asyncio.Task | None = None

    # -- start-up ------------------------------------------------------------------------------------
    def open(self) -> None:
        """Read the repository (fast); raises RepositoryError when nothing could be served."""
        entries, self.problems = scan(self.settings.model_repository)
        for name, problem in self.problems.items():
            log.error("not serving %s: %s", name, problem)
        if not entries:
            raise RepositoryError(f"no servable model in {self.settings.model_repository}")
        self.models = {e.name: ServedModel(e) for e in entries}
        default = self.settings.default_model
        if default is not None and default not in self.models:
            raise RepositoryError(f"VITSERVE_DEFAULT_MODEL={default} is not in the repository "
                                  f"({', '.join(self.models)})")
        self.default_model = default or next(
            (e.name for e in entries if e.task == "classification"), entries[0].name)

    def start(self) -> None:
        self._loading = asyncio.get_running_loop().create_task(self._load_all(), name="load-models")

    async def loaded(self) -> None:
        """Returns once every model is warm or has failed to load."""
        await asyncio.shield(self._loading)

    async def _load_all(self) -> None:
        loop = asyncio.get_running_loop()
        cuda = False
        # fp16 graphs last: whether CUDA works is known once the first other model has opened.
        for served in sorted(self.models.values(), key=lambda m: m.entry.precision == "fp16"):
            entry = served.entry
            try:
                if entry.precision == "fp16" and not cuda:
                    raise RepositoryError("fp16 graphs are served on CUDA only, and CUDA is not usable here")
                providers = self._providers(entry)
                variant = self.models.get(f"{entry.name}-fp16")
                path = variant.entry.path() if cuda and variant is not None else entry.path()
                served.runner = await loop.run_in_executor(
                    self.inference, Runner, path, providers, self.settings.intra_op_threads, self.settings.spin_wait)
                cuda = cuda or served.runner.provider == CUDA
                await loop.run_in_executor(self.inference, self._warm_up, served)
            except Exception as e:  # one broken model must not keep the others from serving
                served.error = str(e)
                log.error("not serving %s: %s", entry.name, e)
                continue
            served.batcher = Batcher(entry.name, served.runner.run, self.inference, self.metrics,
                                     self.settings.max_batch_size, self.settings.max_queue_delay_ms / 1000,
                                     self.settings.queue_limit)
            served.batcher.start()
            served.ready = True
            self.metrics.ready.labels(entry.name).set(1)
            self.metrics.model_info.labels(entry.name, entry.manifest["architecture"], entry.task, entry.precision,
                                           served.runner.provider).set(1)
            log.info("%s ready on %s (%s, %s)", entry.name, served.runner.provider, entry.manifest["architecture"],
                     entry.precision)

    def _warm_up(self, served: ServedModel) -> None:
        """First runs allocate memory and pick kernels; do them before the first request does."""
        h, w = served.entry.policy.size
        start = time.perf_counter()
        for batch in sorted({1, self.settings.max_batch_size}):
            x = np.zeros((batch, 3, h, w), np.float32)
            for _ in range(self.settings.warmup_runs):
                served.runner.run(x)
        log.debug("%s warmed up in %.2fs", served.name, time.perf_counter() - start)

    async def close(self) -> None:
        if self._loading is not None:
            self._loading.cancel()
            await asyncio.gather(self._loading, return_exceptions=True)
        for served in self.models.values():
            if served.batcher is not None:
                await served.batcher.stop()
        self.inference.shutdown(wait=False, cancel_futures=True)
        self.decode.shutdown(wait=False, cancel_futures=True)

    # -- serving -------------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return all(m.ready or m.error for m in self.models.values()) and any(m.ready for m in self.models.values())

    def get(self, name: str | None) -> ServedModel:
        """The named (or default) model, ready to serve; 404 for an unknown name, 503 while it warms up."""
        name = name or self.default_model
        served = self.models.get(name)
        if served is None:
            raise APIError(404, "model_not_found", f"no model named {name!r}; models: {', '.join(self.models)}")
        if served.error:
            raise APIError(503, "model_unavailable", f"{name} failed to load: {served.error}")
        if not served.ready:
            raise APIError(503, "model_loading", f"{name} is still loading",
                           {"Retry-After": str(self.settings.retry_after_s)})
        return served

    async def prepare(self, data: bytes, served: ServedModel) -> tuple[np.ndarray, float]:
        """Decode and preprocess in the decode pool: (model input, seconds it took)."""
        def work() -> tuple[np.ndarray, float]:
            start = time.perf_counter()
            x, _ = prepare(data, served.entry.policy, self.settings.max_image_pixels)
            return x, time.perf_counter() - start

        x, seconds = await asyncio.get_running_loop().run_in_executor(self.decode, work)
        self.metrics.decode_seconds.observe(seconds)
        return x, seconds

    def _providers(self, entry: ModelEntry) -> list[str]:
        return self.settings.providers or entry.manifest.get("providers") or [CUDA, CPU]

    async def explain(self, served: ServedModel, x: np.ndarray) -> list[np.ndarray]:
        """Every layer's attention probabilities for one image, from explain.onnx (opened on first use)."""
        if not served.entry.has("explain"):
            raise APIError(400, "rollout_unavailable", f"{served.name} has no explain graph; use method=last")

        def work() -> list[np.ndarray]:
            if served.explainer is None:  # only the inference thread gets here: no race
                path = verify_file(served.entry, "explain")
                served.explainer = Runner(path, self._providers(served.entry), self.settings.intra_op_threads,
                                          self.settings.spin_wait)
            outputs = served.explainer.run(x[None])
            return [outputs[name][0] for name in served.entry.manifest["attention"]["explain_outputs"]]

        return await asyncio.get_running_loop().run_in_executor(self.inference, work)

    async def infer(self, served: ServedModel, images: list[np.ndarray]) -> list[Result]:
        """Each image through the model's batcher; 503 with Retry-After when the queue is full or slow."""
        try:
            futures = served.batcher.submit(images)
        except QueueFull as e:
            raise overloaded(str(e), self.settings.retry_after_s) from None
        try:
            return await asyncio.wait_for(asyncio.gather(*futures), self.settings.request_timeout_s)
        except TimeoutError:
            for f in futures:
                f.cancel()
            raise overloaded(f"no result from {served.name} within {self.settings.request_timeout_s:g}s",
                             self.settings.retry_after_s) from None
