"""Per-image records: one numpy structured dtype per model holds an image's input and everything it gets back.

A request's images are decoded straight into its records; a batch is gathered from the records of the requests
in it, runs, and writes each image's results (its rows of every output, softmax, top-k, timings) back into
that image's record, once per batch and vectorised. The records are plain memory in this process, or slots of
a worker's shared memory under the process backend: the same code fills both.

Three kinds per image graph (Kind), each its own dtype, which names its kind: it travels with the records, into shared
memory and out of it.
"""
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache

import numpy as np

from repository import ModelEntry

from .heads import Head, head



class Kind(StrEnum):
    """What a record holds of its image, in the order of a batch's rows (the graph returns the images' rows first)."""
    JPEG = "jpeg"  # nothing: its JPEG's bytes travel beside it, decoded with its batch on the GPU (gpu_decode.py)
    IMAGE = "image"  # uint8 [H, W, 3] pixels: the graph's `images` input
    TENSOR = "tensor"  # float32 [3, H, W] normalised pixels: its `pixel_values` input (KServe v2 FP32 clients)
    TEXT = "text"  # int64 token ids: a text tower's input (side_graphs.TEXT), batched apart from images


KINDS = (Kind.JPEG, Kind.IMAGE, Kind.TENSOR)  # an image graph's, in a batch's order
# a batch's size and, per image, its wait and its batch's compute phases (Triton's queue, compute_input,
# compute_infer, compute_output)
TIMINGS = ("batch_size", "queue_ms", "input_ms", "inference_ms", "output_ms")


# bounded: the process backend's workers rebuild their entries at every status push, and the cache holds them
@lru_cache(maxsize=256)
def record_dtype(entry: ModelEntry, kind: Kind) -> np.dtype:
    h, w = entry.policy.size
    fields = {Kind.IMAGE: [("image", np.uint8, (h, w, 3))], Kind.TENSOR: [("tensor", np.float32, (3, h, w))],
              Kind.JPEG: []}[kind]
    fields += [(o["name"], np.float32, tuple(d for d in o["shape"] if d != "batch")) for o in entry.manifest["outputs"]]
    fields += [*head(entry).fields(), ("batch_size", np.int32), *((name, np.float32) for name in TIMINGS[1:])]
    return np.dtype(fields, metadata={"kind": Kind(kind)})


TARGET = "target"  # the relevance graph's second input: a weight vector over the classes per image


def output_names(entry: ModelEntry) -> list[str]:
    return [o["name"] for o in entry.manifest["outputs"]]


def results(records: np.ndarray, fields: list[str]) -> dict[str, np.ndarray]:
    """Copies of the named fields, so the records (shared memory, maybe) can be reused at once."""
    return {name: records[name].copy() for name in fields}


def kind_of(records: np.ndarray) -> Kind:
    """The kind of records of a record_dtype, as their dtype says it."""
    return records.dtype.metadata["kind"]


Rows = slice | np.ndarray  # some rows of a records array: a run of them, or their numbers


def count(rows: Rows) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else len(rows)


def row_numbers(rows: Rows) -> list[int]:
    return list(range(rows.start, rows.stop)) if isinstance(rows, slice) else rows.tolist()


@dataclass(eq=False)
class Part:
    """Some rows of one records array, in one batch, and each row's input where its records do not hold it: a
    JPEG's bytes (Kind.JPEG records, decoded with the batch on the GPU), or for the others a view of the row's input
    in a client's shared-memory region (shared_memory.py), read straight into the batch."""
    records: np.ndarray
    rows: Rows
    top_k: int
    inputs: list | None = None
    errors: dict[int, Exception] = field(default_factory=dict)  # rows that failed alone (a JPEG no decoder read)

    @property
    def kind(self) -> Kind:
        return kind_of(self.records)

    @property
    def size(self) -> int:
        return count(self.rows)

    @property
    def shared(self) -> bool:
        """Its inputs are views of shared memory, not in its records."""
        return self.inputs is not None and self.kind != Kind.JPEG


@dataclass
class Span:
    """Consecutive parts of a batch over the same records, as one index: their rows of the records (a slice where
    they follow each other) and of the batch. The process backend's parts are a worker's frames, slots of its
    arena, so a batch is a few spans, one per worker, however many requests it holds: one numpy call per field
    each."""
    records: np.ndarray
    rows: Rows
    batch: slice
    parts: list[Part]

    @property
    def kind(self) -> Kind:
        return self.parts[0].kind

    @property
    def size(self) -> int:
        return self.batch.stop - self.batch.start


def _as_slice(rows: Rows) -> Rows:
    if isinstance(rows, slice) or not len(rows) or rows[-1] - rows[0] != len(rows) - 1:
        return rows
    return slice(int(rows[0]), int(rows[-1]) + 1) if (np.diff(rows) == 1).all() else rows


def spans(parts: list[Part]) -> list[Span]:
    """The batch's parts (in the batch's order: JPEGs and images before tensors) as spans, for host_inputs and
    write_results. A part whose inputs lie outside its records (in shared memory) is a span of its own."""
    out, row = [], 0
    for part in parts:
        span = out[-1] if out else None
        if span is not None and span.records is part.records and not (part.shared or span.parts[-1].shared):
            span.parts.append(part)
        else:
            out.append(Span(part.records, part.rows, slice(row, row), [part]))
        row += part.size
        out[-1].batch = slice(out[-1].batch.start, row)
    for span in out:
        if len(span.parts) > 1:
            span.rows = np.concatenate([np.arange(p.rows.start, p.rows.stop) if isinstance(p.rows, slice) else p.rows
                                        for p in span.parts])
        span.rows = _as_slice(span.rows)
    return out


def _gather(field: str, batch: list[Span], out: np.ndarray) -> np.ndarray:
    row = 0
    for span in batch:
        if span.parts[0].shared:  # a span of one part (spans)
            for i, view in enumerate(span.parts[0].inputs):
                out[row + i] = view
        else:
            out[row:row + span.size] = span.records[field][span.rows]  # (np.take into `out`: 10x slower on a field)
        row += span.size
    return out


def host_inputs(batch: list[Span], size: tuple[int, int], empty_images: Callable[[int], np.ndarray]
                ) -> tuple[np.ndarray, np.ndarray]:
    """The batch's uint8 images and float pixel_values from its image and tensor spans, in their order; the
    images gathered into `empty_images(count)` (Runner.host_batch: page-locked memory on CUDA)."""
    h, w = size
    images = [span for span in batch if span.kind == Kind.IMAGE]
    tensors = [span for span in batch if span.kind == Kind.TENSOR]
    gathered = _gather("image", images, empty_images(sum(span.size for span in images)))
    pixels = np.empty((sum(span.size for span in tensors), 3, h, w), np.float32)
    return gathered, _gather("tensor", tensors, pixels)


def gather(parts: list[Part], field: str) -> np.ndarray:
    """The parts' rows of one field, in the batch's order (a side graph's batch: relevance maps, texts)."""
    return np.concatenate([part.records[field][part.rows] for part in parts])


def scatter(parts: list[Part], outputs: dict[str, np.ndarray]) -> None:
    """Each part's rows of every output back into its records, in the batch's order (a side graph's batch)."""
    row = 0
    for part in parts:
        for name, value in outputs.items():
            part.records[name][part.rows] = value[row:row + part.size]
        row += part.size


def write_results(batch: list[Span], outputs: dict[str, np.ndarray], queue_ms: list[float],
                  inference_ms: float, input_ms: float, head: Head) -> float:
    """Each part's rows of every output and of what the model's head makes of them (heads.py) into its records,
    in the batch's order (images before tensors), `queue_ms` being each part's wait and `input_ms`,
    `inference_ms` the batch's: one vectorised pass per batch, one numpy call per field and span. Returns the ms it
    took, which every record gets as its output_ms."""
    start = time.perf_counter()
    parts = [part for span in batch for part in span.parts]
    made = head.finish(outputs, max(p.top_k for p in parts))
    waited = np.repeat(np.asarray(queue_ms, np.float32), [p.size for p in parts])
    size = len(waited)
    for span in batch:
        records, rows, of = span.records, span.rows, span.batch
        for name, value in outputs.items():
            records[name][rows] = value[of]
        for name, value in made.items():  # (the first columns of a field: the top k asked for)
            if value.ndim == 1:
                records[name][rows] = value[of]
            else:
                records[name][rows, :value.shape[1]] = value[of]
        records["batch_size"][rows], records["queue_ms"][rows] = size, waited[of]
        records["input_ms"][rows], records["inference_ms"][rows] = input_ms, inference_ms
    output_ms = (time.perf_counter() - start) * 1e3
    for span in batch:
        span.records["output_ms"][span.rows] = output_ms
    return output_ms
