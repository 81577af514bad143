"""A model's text tower (a whole CLIP's or SigLIP's: the manifest's `text`), one object, `TextTower`, that text
embedding and zero-shot labels are made of: what a text may be, how texts become token ids and batch with other
requests' (the side graph side_graphs.TEXT), what comes back, and for labels their prompts, their vectors kept from
earlier requests and how they score an image. Its routes: POST /v1/embeddings, zero-shot POST /classify, and /v2
texts (protocol/).

A text is checked before any work: not empty, no control characters but whitespace, at most
VITSERVE_MAX_TEXT_CHARS characters (its tokens past the model's context are cut, as transformers cuts them), at most
VITSERVE_MAX_TEXTS of them. Tokenizing is the `tokenizers` library's, a request's texts at once (its Rust code, in the
decode pool); the ids are padded with the manifest's pad_id after each text's end to the context length. A causal
text graph (CLIP's) never sees that padding, and a batch is cut to its longest text; SigLIP's sees it, as it was
trained (the manifest's `causal`).
"""
import asyncio
import re
import unicodedata
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from repository import ModelEntry, verify_file
from service.core.errors import BadInput, TooLarge
from service.core.settings import Settings
from service.core.urgency import check_deadline, request_deadline
from service.engine.backends import Backend

from .response_cache import ResponseCache

# Unicode's control characters (Cc) but the whitespace a text may hold: tab, line feed, carriage return
CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def check_texts(texts: list[str], max_texts: int, max_chars: int, what: str = "text") -> None:
    """BadInput or TooLarge, naming the first text that cannot be embedded, by its place, and why."""
    if not texts:
        raise BadInput(f"no {what}s: send at least one", f"no_{what}s")
    if len(texts) > max_texts:
        raise TooLarge(f"{len(texts)} {what}s in one request; at most {max_texts} (VITSERVE_MAX_TEXTS)",
                       f"too_many_{what}s")
    for i, text in enumerate(texts):
        if not text.strip():
            raise BadInput(f"{what} {i} is empty", f"empty_{what}")
        if len(text) > max_chars:
            raise TooLarge(f"{what} {i} has {len(text)} characters; at most {max_chars} (VITSERVE_MAX_TEXT_CHARS)",
                           f"{what}_too_long")
        if (found := CONTROL.search(text)) is not None:
            raise BadInput(f"{what} {i} holds the control character U+{ord(found[0]):04X} "
                           f"({unicodedata.name(found[0], 'unnamed')})", "control_character")


def prompts(labels: list[str], template: str, scores: str, max_texts: int, max_chars: int) -> list[str]:
    """Each label in the template's {} (zero-shot classification's texts); BadInput or TooLarge for labels or a
    template that cannot be scored: softmax (CLIP) needs two labels at least, and no label twice."""
    check_texts(labels, max_texts, max_chars, "label")
    if scores == "softmax" and len(labels) < 2:
        raise BadInput("one label: its softmax over the labels is 1 whatever the image; send two or more",
                       "too_few_labels")
    if len(set(labels)) < len(labels):
        twice = next(label for i, label in enumerate(labels) if label in labels[:i])
        raise BadInput(f"the label {twice!r} is given twice", "duplicate_label")
    check_texts([template], 1, max_chars, "template")
    if template.count("{}") != 1 or template.replace("{}", "").count("{") or template.replace("{}", "").count("}"):
        raise BadInput(f"the template {template!r} must hold {{}} once, where the label goes, and no other braces",
                       "bad_template")
    return [template.replace("{}", label) for label in labels]


def open_tokenizer(path: Path, context_length: int) -> Tokenizer:
    """The model's tokenizer.json, no padding, its texts cut at the context length."""
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.enable_truncation(context_length)
    return tokenizer


def token_batch(tokenizer: Tokenizer, texts: list[str], context_length: int, pad_id: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """(int64 ids [n, context_length], each text's padded with pad_id after its end; int32 token counts [n])."""
    encodings = tokenizer.encode_batch(texts)
    tokens = np.array([len(e.ids) for e in encodings], np.int32)
    ids = np.full((len(texts), context_length), pad_id, np.int64)
    for row, encoding in zip(ids, encodings):
        row[:len(encoding.ids)] = encoding.ids
    return ids, tokens


def normalized(vectors: np.ndarray) -> np.ndarray:
    """Each row divided by its L2 norm (a zero row stays zero, as torch's F.normalize leaves it)."""
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def zero_shot_scores(images: np.ndarray, labels: np.ndarray, text: dict) -> np.ndarray:
    """[n, labels] scores of image embeddings [n, D] against unit label vectors [L, D]: logit_scale * cos +
    logit_bias, then softmax over the labels (CLIP) or each label's sigmoid (SigLIP), as the manifest says."""
    logits = text["logit_scale"] * (normalized(images.astype(np.float32)) @ labels.T) + text["logit_bias"]
    if text["scores"] == "sigmoid":
        return 1 / (1 + np.exp(-logits))
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def best(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row of [n, labels] scores, its k best (indices, scores), best first (ties by label order)."""
    index = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return index, np.take_along_axis(scores, index, axis=1)


class TextTower:
    """A served model version's text tower: its texts' vectors, batched across requests, and zero-shot labels."""

    def __init__(self, entry: ModelEntry, backend: Backend, decode_pool: Executor, settings: Settings,
                 labels: ResponseCache | None, loads: int, step: Callable[[], int]):
        self.entry, self.backend, self.decode_pool, self.settings = entry, backend, decode_pool, settings
        self.text = entry.manifest["text"]
        self.labels = labels  # zero-shot labels' unit vectors, kept by prompt (response_cache.py), None where off
        self.loads = loads  # the backend's load of the version: a reload's labels are not an old load's
        self.step = step  # the most texts a request queues at a time (its model's batching)
        self._tokenizer: Tokenizer | None = None  # opened on first use

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = open_tokenizer(verify_file(self.entry, "tokenizer"), self.text["context_length"])
        return self._tokenizer

    @property
    def size(self) -> int:
        return self.text["size"]

    @property
    def scores(self) -> str:
        return self.text["scores"]

    async def embed(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Texts' embeddings, float32 [n, size], not normalised, and each text's token count [n]: checked,
        tokenized in the decode pool, the request's texts at once, then run in batches with other requests' texts,
        a batch's worth at a time (so that a request's 2,048 texts never hold the whole queue, nor pass its limit)."""
        check_texts(texts, self.settings.max_texts, self.settings.max_text_chars)
        ids, tokens = await asyncio.get_running_loop().run_in_executor(
            self.decode_pool, lambda: token_batch(self.tokenizer, texts, self.text["context_length"],
                                                  self.text["pad_id"]))
        step, vectors = self.step(), []
        for start in range(0, len(texts), step):
            check_deadline(request_deadline(), self.entry.name, f"after {start} of its {len(texts)} texts")
            rows = slice(start, start + step)
            out = await self.backend.side(self.entry.key, "text", {"input_ids": ids[rows], "tokens": tokens[rows]})
            vectors.append(out["embedding"])
        return np.concatenate(vectors), tokens

    def prompts(self, labels: list[str], template: str | None) -> list[str]:
        """Zero-shot labels in the template's {} (the model's own by default), checked before any work: BadInput
        or TooLarge for those that cannot be scored (prompts)."""
        return prompts(labels, self.text["template"] if template is None else template, self.scores,
                       self.settings.max_texts, self.settings.max_text_chars)

    async def label_vectors(self, texts: list[str]) -> np.ndarray:
        """Zero-shot prompts' unit text vectors [labels, size]: those kept from an earlier request are not run
        again."""
        keys = [(self.entry.key, self.loads, prompt) for prompt in texts]
        kept = [self.labels.get(key) if self.labels is not None else None for key in keys]
        missed = [i for i, row in enumerate(kept) if row is None]
        vectors = np.empty((len(texts), self.size), np.float32)
        if missed:
            vectors[missed] = normalized((await self.embed([texts[i] for i in missed]))[0])
        for i, (key, row) in enumerate(zip(keys, kept)):
            if row is not None:
                vectors[i] = row["vector"]
            elif self.labels is not None:
                self.labels.put(key, {"vector": vectors[i].copy()})
        return vectors

    def zero_shot(self, images: np.ndarray, labels: list[str], vectors: np.ndarray, top_k: int) -> list[list[dict]]:
        """Per image embedding [n, D], its top-k of the labels, best first, against their unit vectors, scored as
        the model scores (zero_shot_scores): /classify's predictions."""
        index, score = best(zero_shot_scores(images, vectors, self.text), top_k)
        return [[{"label": labels[i], "index": i, "score": s} for i, s in zip(*row)]
                for row in zip(index.tolist(), score.tolist())]
