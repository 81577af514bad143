"""POST /classify: one image (`file`) or several (`files`, each its own batch item) -> top-k labels."""
import asyncio
import time
import uuid

import numpy as np
from fastapi import APIRouter, File, Query, Request, UploadFile

from ..cache import AttentionRecord
from ..errors import APIError
from ..pool import ModelPool, ServedModel
from ..schemas import ClassifyResponse, ImageResult, Prediction, Timings

router = APIRouter(tags=["inference"])


def softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def top_k(logits: np.ndarray, labels: list[str], k: int) -> list[Prediction]:
    probs = softmax(logits.astype(np.float64))
    order = np.argsort(-probs, kind="stable")[:k]
    return [Prediction(label=labels[i], index=int(i), score=float(probs[i])) for i in order]


async def read_uploads(uploads: list[UploadFile], max_files: int) -> list[tuple[str | None, bytes]]:
    if not uploads:
        raise APIError(400, "no_image", "send an image as the multipart field 'file' (or several as 'files')")
    if len(uploads) > max_files:
        raise APIError(413, "too_many_files", f"{len(uploads)} images in one request; the limit is {max_files}")
    return [(u.filename, await u.read()) for u in uploads]


async def run_images(pool: ModelPool, served: ServedModel, images: list[bytes]):
    """Decode all images concurrently, then batch them: ([inputs], [decode seconds], [results])."""
    with served.batcher.preparing():
        prepared = await asyncio.gather(*(pool.prepare(data, served) for data in images))
    inputs, decode_s = [x for x, _ in prepared], [s for _, s in prepared]
    return inputs, decode_s, await pool.infer(served, inputs)


def attention_outputs(served: ServedModel) -> list[str]:
    return list(served.entry.manifest["attention"]["outputs"].values())


@router.post(
    "/classify", response_model=ClassifyResponse,
    summary="Classify one or several images",
    description="Multipart upload: one image as `file`, or several as `files` (each its own batch item). "
                "Example: `curl -F file=@cat.jpg 'localhost:8000/classify?top_k=5'`.",
    responses={400: {"description": "no image, or an image that cannot be decoded"},
               404: {"description": "unknown model"}, 413: {"description": "upload or image too large"},
               415: {"description": "not an image"}, 503: {"description": "overloaded or still loading"}},
)
async def classify(
    request: Request,
    file: UploadFile | None = File(None, description="one image (JPEG, PNG, WebP, ...)"),
    files: list[UploadFile] | None = File(None, description="several images"),
    model: str | None = Query(None, description="model name (default: the server's default model)"),
    top_k_: int = Query(5, alias="top_k", ge=1, le=100, description="how many labels per image"),
    attention: bool = Query(False, description="keep the attention maps for GET /attention-map"),
) -> ClassifyResponse:
    start = time.perf_counter()
    pool: ModelPool = request.app.state.pool
    served = pool.get(model)
    uploads = await read_uploads(([file] if file else []) + (files or []), pool.settings.max_files)
    _, decode_s, results = await run_images(pool, served, [data for _, data in uploads])
    total_ms = (time.perf_counter() - start) * 1e3
    out = []
    for (filename, data), seconds, result in zip(uploads, decode_s, results):
        item_id = uuid.uuid4().hex
        url = None
        if attention:
            record = AttentionRecord(served.name, {k: result.outputs[k] for k in attention_outputs(served)}, data)
            if request.app.state.attention_cache.put(item_id, record):
                url = f"/attention-map?id={item_id}"
        out.append(ImageResult(
            id=item_id, filename=filename, batch_size=result.batch_size, attention_map_url=url,
            predictions=top_k(result.outputs["logits"], served.entry.labels, top_k_),
            timings_ms=Timings(decode_ms=seconds * 1e3, queue_ms=result.queue_s * 1e3,
                               inference_ms=result.inference_s * 1e3, total_ms=total_ms)))
    return ClassifyResponse(model=served.name, results=out)
