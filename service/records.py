"""Per-image records: one numpy structured dtype per model holds an image's input and everything it gets back.

A request's images are decoded straight into its records; a batch is gathered from the records of the requests
in it, runs, and writes each image's results (its rows of every output, softmax, top-k, timings) back into
that image's record, once per batch and vectorised. The records are plain memory in this process, or slots of
a worker's shared memory under the process backend: the same code fills both.

Three kinds per model: "image" records carry uint8 [H, W, 3] pixels (the graph's `images` input), "tensor"
records float32 [3, H, W] normalised pixels (its `pixel_values` input, for KServe v2 FP32 clients), and "jpeg"
records no input at all: their JPEG bytes travel beside them and are decoded on the GPU with their batch
(gpu_decode.py), straight into the graph's `images` input on the device.
"""
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np

from repository import ModelEntry

MAX_TOP_K = 100
KINDS = ("jpeg", "image", "tensor")  # the order of a batch's rows: the graph returns the images' rows first
TIMINGS = ("batch_size", "queue_ms", "inference_ms")


@cache
def record_dtype(entry: ModelEntry, kind: str) -> np.dtype:
    h, w = entry.policy.size
    classes = len(entry.labels)
    top = min(classes, MAX_TOP_K)
    fields = {"image": [("image", np.uint8, (h, w, 3))], "tensor": [("tensor", np.float32, (3, h, w))],
              "jpeg": []}[kind]
    fields += [(o["name"], np.float32, tuple(d for d in o["shape"] if d != "batch")) for o in entry.manifest["outputs"]]
    fields += [("probs", np.float32, (classes,)), ("top_index", np.int32, (top,)), ("top_score", np.float32, (top,)),
               ("batch_size", np.int32), ("queue_ms", np.float32), ("inference_ms", np.float32)]
    return np.dtype(fields)


def output_names(entry: ModelEntry) -> list[str]:
    return [o["name"] for o in entry.manifest["outputs"]]


def results(records: np.ndarray, fields: list[str]) -> dict[str, np.ndarray]:
    """Copies of the named fields, so the records (shared memory, maybe) can be reused at once."""
    return {name: records[name].copy() for name in fields}


def kind_of(records: np.ndarray) -> str:
    names = records.dtype.names
    return "image" if "image" in names else "tensor" if "tensor" in names else "jpeg"


@dataclass(eq=False)
class Part:
    """Rows [start, stop) of one request's records, in one batch (and their JPEG bytes, for "jpeg" records)."""
    records: np.ndarray
    start: int
    stop: int
    top_k: int
    jpegs: list[bytes] | None = None
    error: Exception | None = None  # set when this part alone failed (a JPEG no decoder could read)

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def kind(self) -> str:
        return kind_of(self.records)


def host_inputs(parts: list[Part], size: tuple[int, int], empty_images: Callable[[int], np.ndarray]
                ) -> tuple[np.ndarray, np.ndarray]:
    """The batch's uint8 images and float pixel_values from its "image" and "tensor" parts, in the parts' order;
    the images gathered into `empty_images(count)` (Runner.host_batch: page-locked memory on CUDA)."""
    h, w = size
    images = [p.records["image"][p.start:p.stop] for p in parts if p.kind == "image"]
    tensors = [p.records["tensor"][p.start:p.stop] for p in parts if p.kind == "tensor"]
    gathered = empty_images(sum(map(len, images)))
    if images:
        np.concatenate(images, out=gathered)
    return gathered, np.concatenate(tensors) if tensors else np.zeros((0, 3, h, w), np.float32)


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def top_k(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the k best (indices, scores), best first; ties keep the lower index first."""
    if k < probs.shape[1]:
        candidates = np.argpartition(-probs, k - 1, axis=1)[:, :k]
    else:
        candidates = np.broadcast_to(np.arange(probs.shape[1]), probs.shape)
    scores = np.take_along_axis(probs, candidates, axis=1)
    order = np.lexsort((candidates, -scores), axis=1)
    index = np.take_along_axis(candidates, order, axis=1)
    return index, np.take_along_axis(scores, order, axis=1)


def write_results(parts: list[Part], outputs: dict[str, np.ndarray], queue_ms: list[float],
                  inference_ms: float) -> None:
    """Each part's rows of every output, softmax and top-k into its records (one vectorised pass per batch)."""
    probs = softmax(outputs["logits"].astype(np.float32))
    k = min(max(p.top_k for p in parts), probs.shape[1], MAX_TOP_K)
    index, score = top_k(probs, k)
    batch, row = sum(p.size for p in parts), 0
    for part, waited in zip(parts, queue_ms):
        rows, records = slice(row, row + part.size), part.records[part.start:part.stop]
        for name, value in outputs.items():
            records[name] = value[rows]
        records["probs"] = probs[rows]
        records["top_index"][:, :k] = index[rows]
        records["top_score"][:, :k] = score[rows]
        records["batch_size"], records["queue_ms"], records["inference_ms"] = batch, waited, inference_ms
        row += part.size
