"""One pipeline per model: decode -> batch -> run -> unbatch.

Routes parse a request and encode the answer; in between, a model's pipeline decodes the uploads in the
decode pool straight into the backend's records (the model's uint8 input, in plain or shared memory), hands
them to the backend, which batches, runs and writes every image's results back into its record, once per
batch, and copies those results out. Where the model is idle, a lone request runs in its decode thread
(Backend.run_here), without the two hops to the inference thread and back. The decoded photo and the model
input are kept only where an attention map needs them, so nothing is decoded twice.
"""
import asyncio
import functools
import logging
import math
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from repository import ModelEntry
from service.core import tracing
from service.core.errors import BadInput, ServiceError, TooLarge, Unavailable, UnsupportedMedia, overloaded
from service.core.metrics import Metrics
from service.core.settings import Settings
from service.core.urgency import check_deadline, expired, request_deadline
from service.engine.backends import Backend, DecodeOn, Lease, graph_entry
from service.engine.batching import BatchingPolicy
from service.engine.heads import OUTPUTS_ONLY, Classifier, Task, head
from service.engine.records import TARGET, TIMINGS, Kind, output_names, record_dtype, results
from service.engine.shared_memory import SharedIO, SharedTensor, Slice
from service.explain.cache import AttentionResult
from service.images.decode import Photo, decode, decode_size, model_input, upload_input
from service.images.gpu_decode import is_jpeg

from .faces import DetectorSettings, FaceBudget, FaceDetector, Faces, FoundFaces, align
from .response_cache import ResponseCache, upload_key
from .texts import TextTower

log = logging.getLogger("vitserve")


@dataclass
class Results:
    """One request's images: their results by record field (the graph's outputs, the head's fields where labels were
    asked for: heads.py, and the timings), each image's decode time and, when kept for attention maps, the decoded
    photos and the model inputs; and the images that could not be read, by index, each with its error (their rows
    ran as zeros and mean nothing)."""
    fields: dict[str, np.ndarray]
    decode_ms: list[float]
    photos: list[Photo | None] | None = None
    inputs: np.ndarray | None = None
    errors: dict[int, ServiceError] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.decode_ms)

    @property
    def batch_size(self) -> np.ndarray:
        """Per image, the size of the batch it ran in (0: answered without one, from the response cache)."""
        return self.fields["batch_size"]

    @property
    def queue_ms(self) -> np.ndarray:
        """Per image, how long it waited for its batch."""
        return self.fields["queue_ms"]

    @property
    def inference_ms(self) -> np.ndarray:
        """Per image, its batch's compute time."""
        return self.fields["inference_ms"]


# fills a job's records in place: each image's decode ms, and the decoded photos where they are kept
Fill = Callable[[np.ndarray], tuple[list[float], list[Photo | None] | None]]


@dataclass(eq=False)
class Job:
    """One request's images on their way through one model (Pipeline._run: fill, batch, collect): n records of
    one kind, how they are filled (in the decode pool, unless there is nothing to decode), and what the run needs
    beside them."""
    kind: Kind  # of records (records.py)
    n: int
    fill: Fill
    top_k: int = 1  # labels per image the answer needs; OUTPUTS_ONLY: the graph's outputs alone (KServe v2)
    for_maps: bool = False  # the photos and the model inputs kept, for attention maps
    in_pool: bool = True  # filled in the decode pool (False: a copy of tensors, no decode: not worth a hop)
    jpegs: list[bytes] | None = None  # Kind.JPEG records' bytes
    shared: SharedIO | None = None  # where a KServe v2 request's input and outputs lie in shared memory
    deadline: float | None = None  # the request's (urgency.py) and its traceparent, read on the event loop
    trace: str | None = None


# what one upload of several can fail with alone: the others are still answered (BadInput covers bad_image)
IMAGE_ERRORS = (BadInput, TooLarge, UnsupportedMedia)


def counted(method):
    """A pipeline method that runs one request on the model, counted in Triton's statistics (statistics.py): its
    outcome and time and, where it succeeded, its rows and its first row's queue and compute times. A request
    whose client left (cancelled) is not counted."""
    @functools.wraps(method)
    async def run(self: "Pipeline", *args, **kwargs):
        start = time.perf_counter()
        try:
            answer = await method(self, *args, **kwargs)
        except Exception:
            self.stats.failed(time.perf_counter() - start)
            raise
        self.stats.succeeded(time.perf_counter() - start, (answer[-1] if isinstance(answer, tuple) else answer).fields)
        return answer

    return run


class Pipeline:
    def __init__(self, entry: ModelEntry, backend: Backend, decode_pool: ThreadPoolExecutor, settings: Settings,
                 metrics: Metrics, detector: FaceDetector | None = None, detector_problem: str | None = None,
                 loads: int = 1, responses: ResponseCache | None = None, labels: ResponseCache | None = None):
        self.entry, self.backend, self.decode_pool, self.settings, self.metrics = (
            entry, backend, decode_pool, settings, metrics)
        self.responses = responses  # answers kept by upload (response_cache.py), None where it is off
        self._text_tower = TextTower(entry, backend, decode_pool, settings, labels, loads, self._text_step) \
            if entry.has("text") else None
        self.loads = loads  # the backend's load of the model version it was made for
        self.detector, self.detector_problem = detector, detector_problem  # expression models' faces
        # the name clients call it by; the key the backend serves this version by (NAME, or NAME@VERSION)
        self.name, self.key, self.policy = entry.name, entry.key, entry.policy
        # an answer's fields: the graph's outputs, what its head makes of them (heads.py) where labels are asked
        # for, and the timings
        self.output_fields = [*output_names(entry), *TIMINGS]
        self.fields = [*output_names(entry), *(name for name, *_ in head(entry).fields()), *TIMINGS]
        self.attention_outputs = list(entry.attention["outputs"].values()) if entry.attention else []
        self.stats = metrics.request_observer(self.name, str(entry.version))
        self._queue_series: dict[str, object] = {}  # by graph (_queue_seconds)
        self._batching: BatchingPolicy | None = None
        self._decoded_on = {where: metrics.images_decoded.labels(self.name, where) for where in DecodeOn}

    @property
    def plan(self) -> str | None:
        """What computes this model's answers now (ModelStatus.runs): each answer names it."""
        status = self.backend.status().get(self.key)
        return status.runs if status is not None else None

    def _text_step(self) -> int:
        """The most texts a request queues at a time: a batch's worth, and within the queue."""
        return min(self.batching.max_batch_size, self.batching.queue_limit)

    @property
    def batching(self) -> BatchingPolicy:
        """The batching of the graph that runs this model's batches (its manifest's, where it has one): read once
        the backend has said which graph that is (a reload makes a new pipeline)."""
        if self._batching is not None:
            return self._batching
        status = self.backend.status()
        policy = BatchingPolicy.of(self.settings, graph_entry(self.backend.entries, status, self.key))
        if getattr(status.get(self.key), "graph", None):
            self._batching = policy
        return policy

    async def images(self, uploads: list[bytes], top_k: int = 1, for_maps: bool = False) -> Results:
        """`run_images`, where the response cache is on (and no photo is kept for a map) for the uploads it has not
        answered before on this model version with this top_k; the others are answered from it, without a decode
        or a batch (their rows' batch_size and times 0). top_k OUTPUTS_ONLY: the graph's outputs alone (/embed)."""
        if self.responses is None or for_maps:
            return await self.run_images(uploads, top_k, for_maps)
        fields = self.output_fields if top_k == OUTPUTS_ONLY else self.fields
        start = time.perf_counter()
        keys = await asyncio.get_running_loop().run_in_executor(  # hashing megabytes is no work for the loop
            self.decode_pool, lambda: [upload_key(self.key, self.loads, top_k, data) for data in uploads])
        rows = [self.responses.get(key) for key in keys]
        missed = [i for i, row in enumerate(rows) if row is None]
        self.stats.looked_up(len(uploads) - len(missed), len(missed), time.perf_counter() - start)
        if not missed:
            return Results({name: np.stack([row[name] for row in rows]) for name in fields}, [0.0] * len(rows))
        out = await self.run_images([uploads[i] for i in missed], top_k, answered=len(uploads) - len(missed))
        for j, i in enumerate(missed):
            if j not in out.errors:
                row = {name: np.array(out.fields[name][j]) for name in fields}  # copies, scalars 0-d
                for name in TIMINGS:  # what a later hit says: no batch, no wait
                    row[name][...] = 0
                self.responses.put(keys[i], row)
        if len(missed) == len(uploads):
            return out
        at = {i: j for j, i in enumerate(missed)}
        merged = {name: np.stack([out.fields[name][at[i]] if i in at else row[name] for i, row in enumerate(rows)])
                  for name in fields}
        return Results(merged, [out.decode_ms[at[i]] if i in at else 0.0 for i in range(len(rows))],
                       errors={i: out.errors[j] for i, j in at.items() if j in out.errors})

    @counted
    async def run_images(self, uploads: list[bytes], top_k: int = 1, for_maps: bool = False, answered: int = 0
                         ) -> Results:
        """Each upload decoded into one image record and run; where the backend decodes JPEGs on the GPU (and no
        photo is kept for a map), JPEGs go there undecoded. An upload that cannot be read fails alone (in
        Results.errors) where others can be answered, these or the request's `answered` elsewhere (the response
        cache's); where none can, its error is the request's. The request's deadline is checked between uploads:
        a decode is not interrupted, so the 504 comes at most one upload's decode late."""
        if self._to_gpu(uploads, for_maps):
            try:
                out = await self._jpegs(uploads, top_k)
                self._decoded_on[DecodeOn.GPU].inc(len(uploads))
                return out
            except IMAGE_ERRORS:
                if len(uploads) == 1:
                    raise  # one of several failed on the GPU: the CPU then tells which (rare)
        errors: dict[int, ServiceError] = {}
        deadline = request_deadline()  # (read here, on the event loop: the decode thread has no context)

        def fill(records: np.ndarray) -> tuple[list[float], list[Photo | None] | None]:
            decode_ms, photos = [], []
            for i, data in enumerate(uploads):
                if i:
                    check_deadline(deadline, self.name, f"after {i} of its {len(uploads)} images' decode")
                start = time.perf_counter()
                try:
                    if for_maps:  # the photo itself, for the maps drawn over it
                        photos.append(decode(data, self.policy.draft_side, self.settings.max_image_pixels))
                        records["image"][i] = model_input(photos[-1].image, self.policy)
                    else:
                        records["image"][i] = upload_input(data, self.policy, self.settings.max_image_pixels)
                except IMAGE_ERRORS as e:
                    if len(errors) + 1 == len(uploads) and not answered:
                        raise
                    errors[i], records["image"][i] = e, 0
                    if for_maps and len(photos) == i:  # (not decoded)
                        photos.append(None)
                decode_ms.append(self._decoded(start))
            return decode_ms, photos if for_maps else None

        out = await self._run(Job(Kind.IMAGE, len(uploads), fill, top_k, for_maps))
        out.errors = errors
        self._decoded_on[DecodeOn.CPU].inc(len(uploads) - len(errors))
        return out

    def _to_gpu(self, uploads: list[bytes], for_maps: bool) -> bool:
        """The decode router: JPEGs go to the GPU's decoder, undecoded, where the model has one, no photo is kept
        for a map, and its queue has room for them; else the CPU decodes them here. So the GPU takes uploads while
        its decode backlog is short and the decode threads the rest, whatever the load (no fixed ratio)."""
        return (not for_maps and self.backend.status()[self.key].decode == DecodeOn.GPU and all(map(is_jpeg, uploads))
                and self.backend.gpu_room(self.key) >= len(uploads))

    async def _jpegs(self, uploads: list[bytes], top_k: int) -> Results:
        def check(records: np.ndarray) -> tuple[list[float], None]:
            for data in uploads:  # the header alone: what the GPU would be asked to decode, and a bomb's refusal
                decode_size(data, self.settings.max_image_pixels)
            return [0.0] * len(uploads), None

        return await self._run(Job(Kind.JPEG, len(uploads), check, top_k, jpegs=uploads))

    async def find_faces(self, upload: bytes, detect: bool, settings: DetectorSettings, budget: FaceBudget
                         ) -> FoundFaces:
        """A photo's faces, found and aligned in a decode thread, or the whole photo as one aligned face, ready for
        their batch (run_faces). The request's deadline is checked before the decode, before the detection and after
        it; a photo of a request whose faces have already passed its budget is neither decoded nor detected."""
        start = time.perf_counter()
        detector = self._detector() if detect else None
        side = self.policy.resize_short_side  # aligned squares, then the model's own resize and crop
        deadline = request_deadline()

        def decode_and_detect() -> tuple[tuple[int, int], Faces | None, list[Photo]]:
            check_deadline(deadline, self.name, "before its decode")
            budget.check()
            if detector is None:
                photo = decode(upload, None, self.settings.max_image_pixels)
                return photo.size, None, [photo]
            # a JPEG decodes reduced (draft mode) as far as detection's copy allows: faces are found on that
            # copy, and aligned from the pixels decoded
            width, height = decode_size(upload, self.settings.max_image_pixels)
            photo = decode(upload, math.ceil(settings.max_side * min(width, height) / max(width, height)),
                           self.settings.max_image_pixels)
            check_deadline(deadline, self.name, "before its face detection")
            budget.check()  # (its decode may have been long)
            found = detector.detect(photo.image, settings)
            budget.take(len(found))
            check_deadline(deadline, self.name, "after its face detection")
            faces = [Photo(face, face.size) for face in align(photo.image, found.landmarks, (side, side))]
            return photo.size, found.scaled(photo.size[0] / photo.image.width), faces

        with self.backend.preparing(self.key):
            size, found, crops = await asyncio.get_running_loop().run_in_executor(self.decode_pool,
                                                                                  decode_and_detect)
        return FoundFaces(size, found, crops, self._decoded(start))

    @counted
    async def run_faces(self, faces: FoundFaces, for_maps: bool = False) -> Results:
        """A photo's aligned faces run in one batch (none: no batch, the deadline still checked)."""
        def fill(records: np.ndarray) -> tuple[list[float], list[Photo] | None]:
            for i, face in enumerate(faces.crops):
                records["image"][i] = model_input(face.image, self.policy)
            return [faces.found_ms] * len(faces.crops), faces.crops if for_maps else None

        return await self._run(Job(Kind.IMAGE, len(faces.crops), fill, 1, for_maps))

    def _detector(self) -> FaceDetector:
        if self.detector is None:
            raise Unavailable(f"face detection is unavailable on this server: {self.detector_problem}; send "
                              "aligned face crops with detect=false", "face_detection_unavailable")
        return self.detector

    @counted
    async def tensors(self, images: np.ndarray | SharedTensor, pixels: np.ndarray | SharedTensor,
                      outputs: dict[str, Slice] | None = None) -> Results:
        """Preprocessed inputs (KServe v2): uint8 [B1, H, W, 3] images and float [B2, 3, H, W] normalised pixels,
        either of them empty, either in shared memory; the results' rows are the images' then the pixels', as the
        graph gives them, and `outputs` names those written to shared memory as well. Each kind goes to the
        batcher as records of its own (one entry each, queued in the same turn of the loop, so they usually share
        a batch); the request counts B1 + B2 images against the queue limit."""
        batches = [(kind, x) for kind, x in ((Kind.IMAGE, images), (Kind.TENSOR, pixels)) if len(x)]
        if not batches:
            raise BadInput("no images to run: every input's batch is empty (shape [0, ...]); send at least one")
        self._check_count(len(images) + len(pixels))
        row_bytes = {name: record_dtype(self.entry, Kind.IMAGE)[name].itemsize for name in outputs or {}}
        for name, place in (outputs or {}).items():
            if place.byte_size < (need := (len(images) + len(pixels)) * row_bytes[name]):
                raise BadInput(f"output {name!r} in shared memory: shared_memory_byte_size {place.byte_size} is "
                               f"too small for its {need} bytes")

        def filler(kind: Kind, x: np.ndarray | SharedTensor) -> Fill:
            def fill(records: np.ndarray) -> tuple[list[float], None]:
                if not isinstance(x, SharedTensor):  # (shared memory is read straight into the batch)
                    records[kind] = x  # one copy of the batch, nothing to decode: not worth a thread hop
                return [0.0] * len(x), None
            return fill

        def shared(x: np.ndarray | SharedTensor, first: int) -> SharedIO | None:
            """Where the run of these rows (the request's first..) finds its input and puts its outputs."""
            place = x.place if isinstance(x, SharedTensor) else None
            if place is None and not outputs:
                return None
            return SharedIO(place, {name: s.rows(first, len(x), row_bytes[name]) for name, s in outputs.items()})

        def job(kind: Kind, x: np.ndarray | SharedTensor, first: int) -> Job:
            return Job(kind, len(x), filler(kind, x), OUTPUTS_ONLY, in_pool=False, shared=shared(x, first))

        if len(batches) == 1:  # (the usual request: no tasks to make and gather)
            (kind, x), = batches
            return await self._run(job(kind, x, 0))
        firsts = [0, len(batches[0][1])]
        runs = [asyncio.ensure_future(self._run(job(kind, x, first))) for (kind, x), first in zip(batches, firsts)]
        try:
            done = await asyncio.gather(*runs)
        except BaseException:  # one failed (overloaded, say) or the client left: the other leaves the queue too
            for run in runs:
                run.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            raise
        return Results({name: np.concatenate([out.fields[name] for out in done]) for name in done[0].fields},
                       [ms for out in done for ms in out.decode_ms])

    async def relevance(self, images: np.ndarray, targets: np.ndarray) -> Results:
        """Class-specific maps of uint8 model inputs [n, H, W, 3], a target weight vector over the classes each
        (zeros: the image's top label), run on the relevance graph in a batch with other requests' maps: `logits`
        [n, classes] and `relevance` [n, rows, cells] (models/relevance.py)."""
        self._check_count(len(images))
        check_deadline(request_deadline(), self.name, "before its relevance batch")
        out = await self.backend.side(self.key, "relevance",
                                      {"image": images, TARGET: np.ascontiguousarray(targets, np.float32)})
        return Results(out, [0.0] * len(images))

    def _check_count(self, n: int) -> None:
        if n > (limit := self.batching.queue_limit):  # it would never fit: retrying later (503) cannot help
            raise TooLarge(f"{n} images in one request; this model's queue holds {limit} (VITSERVE_QUEUE_LIMIT, or "
                           "its manifest's batching), so send at most that many at once", "too_many_images")

    async def _run(self, job: Job) -> Results:
        """The job's three steps: its records filled (in the decode pool), batched and run, its results copied
        out."""
        job.deadline, job.trace = request_deadline(), tracing.traceparent()
        if job.n == 0:  # (a photo without faces) nothing to run, but a request past its deadline is still a 504
            check_deadline(job.deadline, self.name, "before its batch")
            return Results({}, [])
        self._check_count(job.n)
        with self.backend.records(self.key, job.kind, job.n) as lease:
            records = lease.records
            decode_ms, photos, ran = await self._fill(job, lease)
            if not ran:
                await self._batch(job, lease)
            self._queue_seconds().observe(float(records["queue_ms"][0]) / 1e3)
            fields = self.output_fields if job.top_k == OUTPUTS_ONLY else self.fields
            inputs = records["image"].copy() if job.for_maps else None
            return Results(results(records, fields), decode_ms, photos, inputs)

    async def _fill(self, job: Job, lease: Lease) -> tuple[list[float], list[Photo | None] | None, bool]:
        """The job's records filled: each image's decode ms, the photos where kept, and whether they ran too (in
        the decode thread, where the model is idle: a lone request spared two thread hops). Past the request's
        deadline, neither."""
        if not job.in_pool:
            check_deadline(job.deadline, self.name, "before its batch")
            return *job.fill(lease.records), False

        def fill_and_run() -> tuple[list[float], list[Photo | None] | None, bool]:
            check_deadline(job.deadline, self.name, "before its decode")
            decode_ms, photos = job.fill(lease.records)
            check_deadline(job.deadline, self.name, "after its decode")
            return decode_ms, photos, job.kind != Kind.JPEG and self.backend.run_here(self.key, lease, job.top_k,
                                                                                    job.trace)

        with self.backend.preparing(self.key), tracing.span("decode", **{"vitserve.images": job.n}):
            return await asyncio.get_running_loop().run_in_executor(self.decode_pool, fill_and_run)

    async def _batch(self, job: Job, lease: Lease) -> None:
        """The job's records batched and run, waited for up to the server's bound, or the client's deadline where
        it comes first."""
        wait = self.settings.request_timeout_s
        client_first = job.deadline is not None and job.deadline - time.perf_counter() < wait
        queued_ns = time.time_ns()
        try:
            async with asyncio.timeout(job.deadline - time.perf_counter() if client_first else wait):
                await self.backend.run(self.key, lease, job.top_k, job.jpegs, job.shared)
        except TimeoutError:
            if client_first:
                raise expired(self.name, "in the queue") from None
            raise overloaded(f"no result from {self.name} within {self.settings.request_timeout_s:g}s",
                             self.settings.retry_after_s) from None
        tracing.past_span("queue", queued_ns, float(lease.records["queue_ms"][0]) / 1e3)

    def _queue_seconds(self):
        """The queue time histogram of the graph that serves this model, looked up once per graph."""
        graph = self.backend.status()[self.key].graph or self.key
        if (series := self._queue_series.get(graph)) is None:
            series = self._queue_series[graph] = self.metrics.queue_seconds.labels(graph)
        return series

    def _decoded(self, start: float) -> float:
        seconds = time.perf_counter() - start
        self.metrics.decode_seconds.observe(seconds)
        return seconds * 1e3

    def check_attention(self, method: str | None = None) -> None:
        """BadInput, before any work, for maps this model cannot draw: `method`'s (last and rollout read its attention
        outputs, relevance its relevance graph), or with no method, any map at all."""
        if method == "relevance" and not self.entry.has("relevance"):
            if not self.classifies:
                raise BadInput(f"{self.name} has no classifier: a relevance map explains one of a model's labels, and "
                               "it has none. Use method=last or rollout for where it looks", "relevance_unavailable")
            raise BadInput(f"{self.name} has no relevance graph: export it again with this version of python -m "
                           "export (without --no-explain) for method=relevance", "relevance_unavailable")
        if self.entry.attention is None and (method in ("last", "rollout") or not self.entry.has("relevance")):
            also = " (it has a relevance graph: ask for method=relevance)" if self.entry.has("relevance") else ""
            raise BadInput(f"{self.name} has no attention maps: it has no attention outputs (family "
                           f"{self.entry.manifest['family']}; maps come from ViT, DeiT and Swin models){also}. Ask "
                           "without attention, or name another model", "no_attention")

    @property
    def classifies(self) -> bool:
        """Whether its head gives labels' scores (heads.Classifier): not an embedding model's, nor a task's own."""
        return isinstance(head(self.entry), Classifier)

    def check_classifier(self) -> None:
        """BadInput, before any work, for labels asked of a model without a classifier: an embedding model, or one
        of a task whose head gives no labels' scores."""
        if self.entry.task == Task.EMBEDDING:
            raise BadInput(f"{self.name} is an embedding model: it has no labels to classify with. POST /embed for "
                           "its embeddings, or name a classification model", "embedding_model")
        if not self.classifies:
            raise BadInput(f"{self.name} is a model of task {self.entry.task}, whose head gives no labels' scores: "
                           "name a classification model", "no_classifier")

    def text_tower(self) -> TextTower:
        """Its text tower; BadInput, before any work, for texts asked of a model without one."""
        if self._text_tower is None:
            raise BadInput(f"{self.name} has no text tower: texts are embedded, and labels scored, by a whole CLIP or "
                           "SigLIP (python -m export on its folder). Name such a model", "no_text_tower")
        return self._text_tower

    def check_embedding(self) -> None:
        """BadInput, before any work, for embeddings asked of a model without an embedding output."""
        if self.entry.embedding is None:
            raise BadInput(f"{self.name} has no embedding output (family {self.entry.manifest['family']}; every ViT, "
                           "DeiT and Swin exported by this version of python -m export has one: re-export it). Name "
                           "another model", "no_embedding")

    def attention_result(self, out: Results, i: int) -> AttentionResult:
        """Image i's attention result (of a request run with for_maps=True)."""
        photo = out.photos[i]
        backdrop = np.asarray(photo.image) if photo.upload is None else np.frombuffer(photo.upload, np.uint8)
        # copies, not views of the request's rows: the cache's byte count is then what it holds
        return AttentionResult(self.key, {k: out.fields[k][i].copy() for k in self.attention_outputs},
                               out.inputs[i].copy(), backdrop, tuple(photo.size))

    async def store_attention(self, out: Results, i: int) -> str | None:
        """Store image i's attention result for GET /attention-map: its id, or None if it does not fit (or the image
        could not be read)."""
        if i in out.errors:
            return None
        key = uuid.uuid4().hex
        return key if await self.backend.store_attention(key, self.attention_result(out, i)) else None
