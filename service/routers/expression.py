"""POST /expression: find the faces in a photo and give each one's expression probabilities."""
import time
import uuid

from fastapi import APIRouter, Query, Request, Response

from ..faces import DetectorSettings
from ..pipeline import Pipelines
from ..schemas import ExpressionResponse
from .responses import json_response
from .uploads import read_images, upload_body

router = APIRouter(tags=["inference"])


@router.post(
    "/expression", response_model=ExpressionResponse,
    summary="Facial expressions of every face in a photo",
    description="Detects faces (OpenCV Haar cascade), crops each square with a margin, and classifies all faces "
                "of the image in one batch. `detect=false` takes the whole image as one aligned face crop. "
                "No face: 200 with an empty list. Example: `curl -F file=@team.jpg localhost:8000/expression`.",
    openapi_extra=upload_body({"file": "a photo (JPEG, PNG, ...)"}),
)
async def expression(
    request: Request,
    model: str | None = Query(None, description="an expression model (default: the first in the repository)"),
    detect: bool = Query(True, description="find faces; false: the image is already one aligned face crop"),
    max_faces: int | None = Query(None, ge=1, le=100, description="at most this many faces, largest first"),
    attention: bool = Query(False, description="keep each face's attention map for GET /attention-map"),
) -> Response:
    start = time.perf_counter()
    pipelines: Pipelines = request.app.state.pipelines
    settings = pipelines.settings
    pipeline = pipelines.get(model, task="expression")
    ((_, data),) = await read_images(request, ("file",), 1)
    detector = DetectorSettings(settings.face_scale_factor, settings.face_min_neighbors, settings.face_min_size,
                                max_faces or settings.face_max, settings.face_detect_side)
    size, boxes, found_ms, out = await pipeline.faces(data, detect, detector, settings.face_margin, keep=attention)
    labels, f, faces = pipeline.entry.labels, out.fields, []
    for i, (box, probs, batch) in enumerate(zip(boxes, f.get("probs", []), f.get("batch_size", []))):
        key = await pipeline.keep(out, i) if attention else None
        best = int(probs.argmax())
        faces.append({"id": key or uuid.uuid4().hex, "box": list(box), "expression": labels[best],
                      "score": float(probs[best]), "probabilities": dict(zip(labels, probs.tolist())),
                      "batch_size": int(batch), "attention_map_url": f"/attention-map?id={key}" if key else None})
    timings = {"decode_detect_ms": found_ms, "queue_ms": float(f["queue_ms"].max()) if faces else 0.0,
               "inference_ms": float(f["inference_ms"].max()) if faces else 0.0,
               "total_ms": (time.perf_counter() - start) * 1e3}
    return json_response({"model": pipeline.name, "image_size": list(size), "faces": faces, "timings_ms": timings})
