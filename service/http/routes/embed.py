"""POST /embed: one image (`file`) or several (`files`, each its own batch item) -> a vector each, the model's
image embedding (its manifest's `embedding`: the pre-logits feature of every ViT, DeiT and Swin, or an embedding
model's whole answer), L2-normalised unless `normalize=false`, as JSON floats or base64 little-endian float32.

The vectors come from the same pipeline, batcher and response cache as /classify's answers, with no head run for
them (OUTPUTS_ONLY); normalising and encoding are one numpy pass over the request's rows.
"""
import base64
import time
from enum import StrEnum
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, Field

from service.core.urgency import PRIORITY, TIMEOUT_MS, from_query
from service.engine.heads import OUTPUTS_ONLY
from service.pipeline.pipeline import Pipeline
from service.pipeline.served import Pipelines
from service.pipeline.texts import normalized

from ..schemas import EmbedResponse
from .responses import batch_and_timings, json_response
from .uploads import read_images, upload_body

router = APIRouter(tags=["inference"])


class Encoding(StrEnum):
    JSON = "json"  # a list of floats per image
    # the float32 vector's little-endian bytes, base64: a quarter of JSON's bytes and 25-30x less of the event loop
    # at 384-768 floats (docs/performance.md#embeddings)
    BASE64 = "base64"


class EmbedQuery(BaseModel):
    """The query of POST /embed, as FastAPI documents it and hot_routes.py checks it."""
    model: str | None = Field(None, description="model name (default: the server's default model)")
    normalize: bool = Field(True, description="L2-normalise each vector (cosine similarity is then a dot product)")
    encoding: Encoding = Field(Encoding.JSON, description="json: a list of floats per image; base64: its float32 "
                                                          "little-endian bytes, base64 (faster to make and to read)")
    timeout_ms: int | None = Field(None, ge=1, le=3_600_000, description=TIMEOUT_MS)
    priority: int | None = Field(None, ge=0, le=100, description=PRIORITY)


def encoded(vectors: np.ndarray, encoding: Encoding) -> list:
    """Per row, its vector as JSON floats or as base64 float32 bytes."""
    if encoding == Encoding.BASE64:
        rows = np.ascontiguousarray(vectors, "<f4")
        return [base64.b64encode(row.tobytes()).decode() for row in rows]
    return vectors.tolist()


def embeddings(pipeline: Pipeline, fields: dict[str, np.ndarray], normalize: bool) -> np.ndarray:
    """The request's vectors, float32 [n, size], normalised where asked."""
    vectors = fields[pipeline.entry.embedding["output"]]
    return normalized(vectors) if normalize else vectors


@router.post(
    "/embed", response_model=EmbedResponse,
    summary="Embed one or several images",
    description="Multipart upload: one image as `file`, or several as `files` (each its own batch item). Each gets "
                "the model's image embedding. Example: `curl -F file=@cat.jpg 'localhost:8000/embed'`; "
                "`?encoding=base64` for float32 bytes.",
    responses={400: {"description": "no image, an image that cannot be decoded (of several, only where none can: "
                                    "the others are answered, and it gets an `error` of its own), or a model without "
                                    "an embedding output"},
               404: {"description": "unknown model"}, 413: {"description": "upload or image too large, or more images "
                                                                  "than the limit or the model's queue holds"},
               415: {"description": "not an image"}, 503: {"description": "overloaded or still loading"},
               504: {"description": "past the request's timeout_ms"}},
    openapi_extra=upload_body({"file": "one image (JPEG, PNG, WebP, ...)"}, several="files"),
)
async def embed(request: Request, query: Annotated[EmbedQuery, Query()]) -> Response:
    start = time.perf_counter()
    pipelines: Pipelines = request.app.state.pipelines
    from_query(start, query.timeout_ms, query.priority, pipelines.settings.priority_levels)

    async def read(chosen: Pipeline) -> list[tuple[str | None, bytes]]:
        chosen.check_embedding()
        return await read_images(request, ("file", "files"), pipelines.settings.max_files)

    pipeline, uploads = await pipelines.routed(read, query.model)
    out = await pipeline.images([data for _, data in uploads], OUTPUTS_ONLY)
    vectors = encoded(embeddings(pipeline, out.fields, query.normalize), query.encoding)
    total_ms = (time.perf_counter() - start) * 1e3
    results = []
    for i, ((filename, _), vector, ran) in enumerate(zip(uploads, vectors, batch_and_timings(out, total_ms))):
        if (error := out.errors.get(i)) is not None:  # this file alone could not be read
            results.append({"index": i, "filename": filename,
                            "error": {"code": error.code, "message": error.message}})
            continue
        results.append({"index": i, "filename": filename, "embedding": vector, **ran})
    section = pipeline.entry.embedding
    return json_response({"model": pipeline.name, "plan": pipeline.plan, "size": section["size"],
                          "pooling": section["pooling"],
                          "normalized": query.normalize, "encoding": query.encoding, "results": results})
