"""The served models' pipelines, by name and by version, made anew when what the backend serves changes, and what
they share: the decode pool, the response cache, the face detector and the default models."""
import logging
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from repository import RepositoryError, face_detector
from service.core.errors import BadInput, NotFound, Unavailable
from service.core.metrics import Metrics
from service.core.settings import Settings
from service.core.thread_names import name_pool_thread
from service.engine.backends import Backend
from service.engine.heads import Task
from service.engine.runtime import CPU

from .faces import FaceDetector
from .pipeline import Pipeline
from .response_cache import ResponseCache

log = logging.getLogger("vitserve")
T = TypeVar("T")  # what a route reads of a request's body (Pipelines.routed)


class Pipelines:
    """The served models by name, one pipeline each over one backend, and the decode pool they share."""

    def __init__(self, backend: Backend, settings: Settings, metrics: Metrics):
        self.backend, self.settings, self.metrics = backend, settings, metrics
        threads = settings.decode_threads or min(8, os.cpu_count() or 1)
        self.decode_pool = ThreadPoolExecutor(threads, thread_name_prefix="decode", initializer=name_pool_thread)
        self.responses = ResponseCache(settings.response_cache_bytes) if settings.response_cache_bytes else None
        self.labels = ResponseCache(settings.label_cache_bytes) if settings.label_cache_bytes else None
        self.pipelines: dict[str, Pipeline] = {}  # by key
        self._latest: dict[str, Pipeline] = {}  # by name: the version it reaches
        self._generation = -1  # the backend's status generation they were made for
        self.default_model: str | None = None
        self.detector: FaceDetector | None = None
        self.detector_problem: str | None = None

    def open(self) -> None:
        """Once the backend knows its models: a pipeline each, the default model, and the face detector where an
        expression model needs one."""
        entries = self.backend.entries
        if any(e.task == Task.EXPRESSION for e in entries):
            self.detector, self.detector_problem = self._open_detector()
        self._rebuild()
        default, names = self.settings.default_model, sorted({e.name for e in entries})
        if default is not None and default not in names:
            raise RepositoryError(f"VITSERVE_DEFAULT_MODEL={default} is not in the repository ({', '.join(names)})")
        faces = self.settings.default_expression_model
        if faces is not None and faces not in {e.name for e in entries if e.task == Task.EXPRESSION}:
            raise RepositoryError(f"VITSERVE_DEFAULT_EXPRESSION_MODEL={faces} is not an expression model of the "
                                  f"repository ({', '.join(names)})")
        self.default_model = default or next((e.name for e in entries if e.task == Task.CLASSIFICATION),
                                             entries[0].name)

    def _open_detector(self) -> tuple[FaceDetector | None, str | None]:
        """The repository's face detector, on the CPU (its nets are small; each request's detection runs in its
        decode thread), or None and why."""
        entry, problem = face_detector(self.settings.model_repository)
        if entry is None:
            log.error("/expression cannot detect faces: %s", problem)
            return None, problem
        try:
            return FaceDetector(entry, [CPU], self.settings.intra_op_threads), None
        except Exception as e:  # ONNX Runtime's own errors: the models still serve
            log.error("/expression cannot detect faces: %s failed to load: %s", entry.name, e)
            return None, f"{entry.name} failed to load: {e}"

    def close(self) -> None:
        self.decode_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def ready(self) -> bool:
        return self.backend.problem() is None and self.unready() is None

    def unready(self) -> tuple[str, str] | None:
        """Why the server's models are not ready, as (error code, message), or None: a model still loading, or, under
        VITSERVE_STRICT_READINESS (as Triton's --strict-readiness: a balancer sends no traffic to a server missing a
        model), one that does not serve, else none serving. (The inference process's own trouble is the backend's
        `problem`.)"""
        status = self.backend.status()
        if waiting := [name for name, s in status.items() if not s.settled]:
            return "not_ready", f"warming up: {', '.join(waiting)}"
        if self.settings.strict_readiness and (missing := self.not_serving()):
            return "models_not_serving", ("not every model serves (VITSERVE_STRICT_READINESS=false: ready while one "
                                          "does): " + "; ".join(f"{name} does not serve: {why}"
                                                                for name, why in missing.items()))
        if not self.settings.strict_readiness and not any(s.ready for s in status.values()):
            return "not_ready", "no model could be loaded"
        return None

    def not_serving(self) -> dict[str, str]:
        """The models of the repository that do not serve, and why: a failed load, or a folder that cannot be served
        (unloaded ones were asked to stop)."""
        failed = {key: s.error for key, s in self.backend.status().items() if s.error is not None and not s.unloaded}
        return failed | self.backend.problems

    def _rebuild(self) -> None:
        """A pipeline per model version the backend serves or loads (not those unloaded), by key, made anew after
        a reload; and which version each name reaches (the latest ready, else the latest)."""
        status, live = self.backend.status(), {}
        for entry in self.backend.entries:
            s = status.get(entry.key)
            if s is None or s.unloaded:
                continue
            pipeline = self.pipelines.get(entry.key)
            # the same load of the same manifest: a new inference process (its loads counted from 1 again) may have
            # read a folder changed on disk
            same = pipeline is not None and pipeline.loads == s.loads and pipeline.entry.manifest == entry.manifest
            if pipeline is not None and not same:  # reloaded: its answers may not be the new weights'
                for cache in (self.responses, self.labels):
                    if cache is not None:
                        cache.forget(entry.key)
            live[entry.key] = pipeline if same else Pipeline(
                entry, self.backend, self.decode_pool, self.settings, self.metrics, self.detector,
                self.detector_problem, s.loads, self.responses, self.labels)
        latest: dict[str, Pipeline] = {}
        for key, pipeline in live.items():
            best = latest.get(pipeline.name)
            if best is None or (status[key].ready, pipeline.entry.version) > (status[best.key].ready,
                                                                                best.entry.version):
                latest[pipeline.name] = pipeline
        self.pipelines, self._latest, self._generation = live, latest, self.backend.generation

    def find(self, name: str, version: str | None = None) -> Pipeline | None:
        """The model's pipeline, ready or not: the version asked for, else the one its name reaches; None for a
        name or version not served."""
        self._sync()
        if not version:
            return self._latest.get(name)
        return next((p for p in self.pipelines.values() if p.name == name and str(p.entry.version) == version),
                    None)

    def every(self) -> list[Pipeline]:
        """Every model version served or loading (not those unloaded)."""
        self._sync()
        return list(self.pipelines.values())

    def versions(self, name: str) -> list[str]:
        """Every version of the model that serves or loads, oldest first."""
        self._sync()
        return sorted((str(p.entry.version) for p in self.pipelines.values() if p.name == name), key=int)

    def keyed(self, key: str) -> Pipeline | None:
        """The pipeline of one model version, by its key (as attention records name it)."""
        self._sync()
        return self.pipelines.get(key)

    @property
    def default_expression_model(self) -> str | None:
        """The model of /expression requests that name none: VITSERVE_DEFAULT_EXPRESSION_MODEL, else the first
        expression model served, by name."""
        self._sync()
        served = sorted(p.name for p in self._latest.values() if p.entry.task == Task.EXPRESSION)
        return self.settings.default_expression_model or next(iter(served), None)

    def _sync(self) -> None:
        if self._generation != self.backend.generation:  # loaded, reloaded or unloaded since: rare
            self._rebuild()

    async def routed(self, read: Callable[[Pipeline], Awaitable[T]], name: str | None, task: str | None = None,
                     version: str | None = None) -> tuple[Pipeline, T]:
        """The model's pipeline (`get`), and what `read` makes of the request's body, given the pipeline it reads
        for. The model is looked up before the body is read, so that an unknown or unready one fails first (and
        `read` may check more of it), and again once the body is in, so that no await separates the pipeline from
        the records the request takes (Backend.preparing, records): a version being unloaded meanwhile is then
        either not chosen, or counts the request before its drain finishes."""
        body = await read(self.get(name, task, version))
        return self.get(name, task, version), body

    def get(self, name: str | None, task: str | None = None, version: str | None = None) -> Pipeline:
        """The named (or default) model, ready to serve (the version asked for, else the one its name reaches):
        NotFound for an unknown name or version, Unavailable while it warms up or after it failed, BadInput when
        it is not a model for `task`. A route with a body finds its model through `routed`."""
        if (problem := self.backend.problem()) is not None:  # the inference process restarting, or hung
            raise problem
        if name is None and task == Task.EXPRESSION:
            name = self.default_expression_model
            if name is None:
                raise NotFound("the repository has no expression model (task: expression)", "model_not_found")
        name = name or self.default_model
        pipeline = self.find(name, version)
        if pipeline is None:
            raise NotFound(f"no model named {name!r}" + (f" of version {version}" if version else "") +
                           f"; models: {', '.join(sorted(self._latest))}", "model_not_found")
        status = self.backend.status()[pipeline.key]
        if status.error:
            raise Unavailable(f"{name} failed to load: {status.error}", "model_unavailable")
        if not status.ready:
            raise Unavailable(f"{name} is still loading", "model_loading", self.settings.retry_after_s)
        if task is not None and pipeline.entry.task != task:
            raise BadInput(f"{name} is a model of task {pipeline.entry.task}; this route needs a model exported with "
                           f"task {task}", f"not_an_{task}_model")
        return pipeline
