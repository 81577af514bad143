"""What a model's task makes of its graph's outputs, per image, once per batch: the fields its head adds to every
image's record (records.record_dtype) and how it fills them (records.write_results). The batch core knows the
graph's outputs and the timings alone: a new task adds a head here, and touches nothing there.

Classification and expression models share one head: the logits' scores (a softmax, or each label's sigmoid for
a multi-label classifier: the manifest's `scores`) and their top k, k the most any request of the batch asked for.
A batch of requests that ask for none (KServe v2 clients, who get the graph's outputs alone) costs nothing here.
"""
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from typing import Protocol

import numpy as np

from repository import ModelEntry

MAX_TOP_K = 100
OUTPUTS_ONLY = 0  # a request's top_k that asks for the graph's outputs alone (KServe v2): no head runs for it


class Head(Protocol):
    """What a task makes of its graph's outputs, per image, once per batch (Classifier is the one shipped)."""

    def fields(self) -> list[tuple]:
        """The fields of a record that this head fills (numpy structured dtype fields)."""

    def finish(self, outputs: dict[str, np.ndarray], k: int) -> dict[str, np.ndarray]:
        """The batch's rows of each field, from its outputs, where its requests ask for k labels each at most
        (OUTPUTS_ONLY: nothing)."""


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def sigmoid(logits: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.tanh(0.5 * logits))  # 1 / (1 + e^-x) without overflow for large negative logits


# the manifest's `scores`: how a model's logits become its labels' scores (one class per image, or each label on
# its own: a multi-label classifier)
SCORES = {"softmax": softmax, "sigmoid": sigmoid}


def top_k(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the k best (indices, scores), best first; ties keep the lower index first."""
    if probs.shape[1] <= 64:  # few classes: one stable sort costs less than a partition and a sort of it
        index = np.argsort(-probs, axis=1, kind="stable")[:, :k]
        return index, np.take_along_axis(probs, index, axis=1)
    if k < probs.shape[1]:
        candidates = np.argpartition(-probs, k - 1, axis=1)[:, :k]
    else:
        candidates = np.broadcast_to(np.arange(probs.shape[1]), probs.shape)
    scores = np.take_along_axis(probs, candidates, axis=1)
    order = np.lexsort((candidates, -scores), axis=1)
    index = np.take_along_axis(candidates, order, axis=1)
    return index, np.take_along_axis(scores, order, axis=1)


@dataclass(frozen=True)
class Classifier:
    """The labels' scores of the graph's `logits` (`probs`) and the best `top` of them (`top_index`, `top_score`)."""
    scores: str  # a key of SCORES
    classes: int

    @property
    def top(self) -> int:
        return min(self.classes, MAX_TOP_K)

    @classmethod
    def of(cls, entry: ModelEntry) -> "Classifier":
        return cls(entry.scores, len(entry.labels))

    def fields(self) -> list[tuple]:
        """The fields of a record that this head fills (numpy structured dtype fields)."""
        return [("probs", np.float32, (self.classes,)), ("top_index", np.int32, (self.top,)),
                ("top_score", np.float32, (self.top,))]

    @staticmethod
    def best(fields: dict[str, np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
        """Per image of a request's results (its fields), its k best labels' (indices, scores), best first."""
        k = min(k, fields["top_index"].shape[1])
        return fields["top_index"][:, :k], fields["top_score"][:, :k]

    @staticmethod
    def scored(fields: dict[str, np.ndarray]) -> np.ndarray:
        """Per image of a request's results, every label's score (float32 [n, classes])."""
        return fields["probs"]

    def finish(self, outputs: dict[str, np.ndarray], k: int) -> dict[str, np.ndarray]:
        """The batch's rows of each field, from its outputs, where its requests ask for k labels each at most
        (OUTPUTS_ONLY: none); a field narrower than the record's fills the record's first columns."""
        if k == OUTPUTS_ONLY:
            return {}
        probs = SCORES[self.scores](outputs["logits"].astype(np.float32))
        index, score = top_k(probs, min(k, self.top))
        return {"probs": probs, "top_index": index, "top_score": score}


@dataclass(frozen=True)
class EmbeddingOnly:
    """An embedding model's head: its graph's `embeddings` is the whole answer (normalised per request, where
    asked, by POST /embed), so there is nothing to add."""

    @classmethod
    def of(cls, entry: ModelEntry) -> "EmbeddingOnly":
        return cls()

    def fields(self) -> list[tuple]:
        return []

    def finish(self, outputs: dict[str, np.ndarray], k: int) -> dict[str, np.ndarray]:
        return {}


class Task(StrEnum):
    """The tasks the service's own routes serve (a manifest's `task`); HEADS may hold others, each with its route."""
    CLASSIFICATION = "classification"  # POST /classify, and /v2 (and POST /embed: every transformer's embedding)
    EXPRESSION = "expression"  # POST /expression: the faces found in photos, each classified
    EMBEDDING = "embedding"  # POST /embed alone, and /v2: a model without a classifier


HEADS: dict[str, Callable[[ModelEntry], Head]] = {Task.CLASSIFICATION: Classifier.of, Task.EXPRESSION: Classifier.of,
                                                  Task.EMBEDDING: EmbeddingOnly.of}


# bounded: the process backend's workers rebuild their entries at every status push, and the cache holds them
@lru_cache(maxsize=256)
def head(entry: ModelEntry) -> Head:
    """The head of a model version's task."""
    return HEADS[entry.task](entry)
