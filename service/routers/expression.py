"""POST /expression: find the faces in a photo and give each one's expression probabilities."""
import asyncio
import io
import time
import uuid

import numpy as np
from fastapi import APIRouter, File, Query, Request, UploadFile
from PIL import Image

from ..cache import AttentionRecord
from ..errors import APIError
from ..faces import DetectorSettings, crop_face, detect_faces
from ..pool import ModelPool, ServedModel
from ..preprocess import decode, normalise, resize_and_crop
from ..schemas import ExpressionResponse, ExpressionTimings, Face
from .classify import attention_outputs, read_uploads, softmax

router = APIRouter(tags=["inference"])


def expression_model(pool: ModelPool, name: str | None) -> ServedModel:
    if name is None:
        name = next((m.name for m in pool.models.values() if m.entry.task == "expression"), None)
        if name is None:
            raise APIError(404, "model_not_found", "the repository has no expression model (task: expression)")
    served = pool.get(name)
    if served.entry.task != "expression":
        raise APIError(400, "not_an_expression_model", f"{name} is a {served.entry.task} model; /expression "
                                                       "needs a model exported with task expression")
    return served


def find_faces(data: bytes, detect: bool, detector: DetectorSettings, margin: float,
               max_pixels: int) -> tuple[tuple[int, int], list[tuple[int, int, int, int]], list[Image.Image]]:
    """Decode and find the faces (or take the whole image as one aligned face): size, boxes, face regions."""
    image = decode(data, None, max_pixels)
    if not detect:
        return image.size, [(0, 0, *image.size)], [image]
    boxes = detect_faces(image, detector)
    return image.size, boxes, [crop_face(image, box, margin) for box in boxes]


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@router.post(
    "/expression", response_model=ExpressionResponse,
    summary="Facial expressions of every face in a photo",
    description="Detects faces (OpenCV Haar cascade), crops each square with a margin, and classifies all faces "
                "of the image in one batch. `detect=false` takes the whole image as one aligned face crop. "
                "No face: 200 with an empty list. Example: `curl -F file=@team.jpg localhost:8000/expression`.",
)
async def expression(
    request: Request,
    file: UploadFile = File(..., description="a photo (JPEG, PNG, ...)"),
    model: str | None = Query(None, description="an expression model (default: the first in the repository)"),
    detect: bool = Query(True, description="find faces; false: the image is already one aligned face crop"),
    max_faces: int | None = Query(None, ge=1, le=100, description="at most this many faces, largest first"),
    attention: bool = Query(False, description="keep each face's attention map for GET /attention-map"),
) -> ExpressionResponse:
    start = time.perf_counter()
    pool: ModelPool = request.app.state.pool
    settings = pool.settings
    served = expression_model(pool, model)
    ((_, data),) = await read_uploads([file], 1)
    detector = DetectorSettings(settings.face_scale_factor, settings.face_min_neighbors, settings.face_min_size,
                                max_faces or settings.face_max, settings.face_detect_side)
    with served.batcher.preparing():
        size, boxes, regions = await asyncio.get_running_loop().run_in_executor(
            pool.decode, find_faces, data, detect, detector, settings.face_margin, settings.max_image_pixels)
    policy = served.entry.policy
    inputs = [normalise(resize_and_crop(region, policy), policy) for region in regions]
    prepared_ms = (time.perf_counter() - start) * 1e3
    results = await pool.infer(served, inputs) if inputs else []
    labels, faces = served.entry.labels, []
    for box, region, result in zip(boxes, regions, results):
        probs = softmax(result.outputs["logits"].astype(np.float64))
        face_id, url = uuid.uuid4().hex, None
        if attention:
            # the face region at the photo's resolution: the map is drawn over what the model saw, full size
            image_bytes = data if not detect else png(region)
            record = AttentionRecord(served.name, {k: result.outputs[k] for k in attention_outputs(served)}, image_bytes)
            if request.app.state.attention_cache.put(face_id, record):
                url = f"/attention-map?id={face_id}"
        best = int(probs.argmax())
        faces.append(Face(id=face_id, box=list(box), expression=labels[best], score=float(probs[best]),
                          probabilities={label: float(p) for label, p in zip(labels, probs)},
                          batch_size=result.batch_size, attention_map_url=url))
    timings = ExpressionTimings(decode_detect_ms=prepared_ms,
                                queue_ms=max((r.queue_s for r in results), default=0.0) * 1e3,
                                inference_ms=max((r.inference_s for r in results), default=0.0) * 1e3,
                                total_ms=(time.perf_counter() - start) * 1e3)
    return ExpressionResponse(model=served.name, image_size=list(size), faces=faces, timings_ms=timings)
