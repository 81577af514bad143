"""A model's side graphs: graphs beside its main one whose records batch apart from its images (Backend.side). Each
is one object: what its record holds (the inputs a request fills, the outputs its batch writes), how its session
opens, and how a batch runs. The backends batch and carry side graphs by name alone (the process backend's SIDE
message), so a new one is written here and asked for with Backend.side, and nothing else in the engine changes.

  relevance  the class-specific maps (models/relevance.py): uint8 images and a target each -> logits and maps
  text       a whole CLIP's or SigLIP's text tower: token ids and their count -> the texts' embeddings
"""
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from repository import ModelEntry
from service.core.settings import Settings

from .records import TARGET, Kind
from .runtime import Runner, open_session

Batch = dict[str, np.ndarray]  # a batch's rows of some of a record's fields, by field


@dataclass(frozen=True)
class SideGraph:
    name: str  # its file's kind in the manifest (entry.has), and its batcher's
    inputs: tuple[str, ...]  # the record's fields a request fills
    outputs: tuple[str, ...]  # those its batch writes
    record: Callable[[ModelEntry], np.dtype]  # one item's record
    open: Callable[[Path, ModelEntry, list[str], Settings], object]  # its session, on first use
    run: Callable[[object, ModelEntry, Batch], Batch]  # (session, entry, the batch's inputs) -> its outputs
    missing: str  # BadInput's message for a model without it ({model})
    missing_code: str


@lru_cache(maxsize=256)
def relevance_record(entry: ModelEntry) -> np.dtype:
    """The image and its target in, the logits and the map out."""
    h, w = entry.policy.size
    section, classes = entry.manifest["relevance"], len(entry.labels)
    cells = section["grid"][0] * section["grid"][1]
    fields = [("image", np.uint8, (h, w, 3)), (TARGET, np.float32, (classes,)), ("logits", np.float32, (classes,)),
              ("relevance", np.float32, (len(section["rows"]), cells))]
    return np.dtype(fields, metadata={"kind": Kind.IMAGE})


def open_relevance(path: Path, entry: ModelEntry, providers: list[str], settings: Settings) -> Runner:
    return Runner(path, (entry.manifest["input"]["name"], TARGET), providers, settings.intra_op_threads,
                  settings.spin_wait, settings.cuda_tf32, iobinding=settings.iobinding)


def run_relevance(runner: Runner, entry: ModelEntry, batch: Batch) -> Batch:
    outputs = runner.run(batch["image"], batch[TARGET])
    return {"logits": outputs["logits"], "relevance": outputs["relevance"]}


@lru_cache(maxsize=256)
def text_record(entry: ModelEntry) -> np.dtype:
    """A text's token ids, padded to the context length, and how many there are in; its embedding out."""
    text = entry.manifest["text"]
    fields = [("input_ids", np.int64, (text["context_length"],)), ("tokens", np.int32),
              ("embedding", np.float32, (text["size"],))]
    return np.dtype(fields, metadata={"kind": Kind.TEXT})


def open_text(path: Path, entry: ModelEntry, providers: list[str], settings: Settings) -> object:
    return open_session(path, providers, settings.intra_op_threads, settings.spin_wait, settings.cuda_tf32)


def run_text(session, entry: ModelEntry, batch: Batch) -> Batch:
    """The batch's ids, cut to its longest text's tokens where the tower is causal (CLIP's: no token sees the
    padding after it); SigLIP's sees its padding, and runs the whole context."""
    text, ids = entry.manifest["text"], batch["input_ids"]
    if text.get("causal", True):
        ids = ids[:, :batch["tokens"].max()]
    return {"embedding": session.run([text["output"]], {text["input"]: ids})[0]}


RELEVANCE = SideGraph(
    "relevance", ("image", TARGET), ("logits", "relevance"), relevance_record, open_relevance, run_relevance,
    "{model} has no relevance graph: export it again with this version of python -m export (without --no-explain) "
    "for method=relevance", "relevance_unavailable")
TEXT = SideGraph(
    "text", ("input_ids", "tokens"), ("embedding",), text_record, open_text, run_text,
    "{model} has no text tower", "no_text_tower")
SIDE_GRAPHS = {side.name: side for side in (RELEVANCE, TEXT)}
