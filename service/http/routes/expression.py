"""POST /expression: find the faces in a photo (or in each of several) and give each one's expression
probabilities."""
import asyncio
import time
import uuid

import numpy as np
from fastapi import APIRouter, Query, Request, Response

from service.core.errors import BadInput
from service.core.memory import release_memory
from service.core.urgency import PRIORITY, TIMEOUT_MS, from_query
from service.engine.heads import Classifier, Task
from service.pipeline.faces import DetectorSettings, FaceBudget, Faces, FoundFaces
from service.pipeline.pipeline import IMAGE_ERRORS, Pipeline
from service.pipeline.served import Pipelines

from ..schemas import ExpressionResponse, ExpressionResults
from .responses import json_response
from .uploads import read_uploads, upload_body

router = APIRouter(tags=["inference"])


@router.post(
    "/expression", response_model=ExpressionResponse | ExpressionResults,
    responses={504: {"description": "past the request's timeout_ms"}},
    summary="Facial expressions of every face in a photo",
    description="Detects faces and their five landmarks (MTCNN), aligns each face by its landmarks, and classifies "
                "all faces of the image in one batch. `detect=false` takes the whole image as one aligned face "
                "crop. No face: 200 with an empty list. Several photos as `files`: one entry each, in order, a "
                "photo that cannot be read with its own error. Example: "
                "`curl -F file=@team.jpg localhost:8000/expression`.",
    openapi_extra=upload_body({"file": "a photo (JPEG, PNG, ...)"}, several="files"),
)
async def expression(
    request: Request,
    model: str | None = Query(None, description="an expression model (default: VITSERVE_DEFAULT_EXPRESSION_MODEL, "
                                                "else the first by name: expression-fer2013 of the embedded ones)"),
    detect: bool = Query(True, description="find faces; false: the image is already one aligned face crop"),
    max_faces: int | None = Query(None, ge=1, le=100, description="at most this many faces, largest first"),
    attention: bool = Query(False, description="keep each face's attention map for GET /attention-map (a "
                                               "transformer's: 400 for a CNN such as expression-fer2013)"),
    timeout_ms: int | None = Query(None, ge=1, le=3_600_000, description=TIMEOUT_MS),
    priority: int | None = Query(None, ge=0, le=100, description=PRIORITY),
) -> Response:
    start = time.perf_counter()
    pipelines: Pipelines = request.app.state.pipelines
    settings = pipelines.settings
    from_query(start, timeout_ms, priority, settings.priority_levels)

    async def read(chosen: Pipeline) -> list[tuple[str, str | None, bytes]]:
        if attention:
            chosen.check_attention()
        return await read_uploads(request, ("file", "files"), settings.max_files)

    pipeline, uploads = await pipelines.routed(read, model, task=Task.EXPRESSION)
    if (fields := [field for field, _, _ in uploads]).count("file") > 1:  # several photos come as `files`
        raise BadInput(f"{fields.count('file')} 'file' parts; send one photo as 'file', or several as 'files'",
                       "one_image")
    detector = DetectorSettings(settings.face_min_size, max_faces or settings.face_max, settings.face_detect_side)
    budget = FaceBudget(min(settings.face_request_max, pipeline.batching.queue_limit))
    if not detect:  # each photo is one face: known before any work
        budget.take(len(uploads))
        budget.check()
    if fields == ["file"]:
        found = await pipeline.find_faces(uploads[0][2], detect, detector, budget)
        budget.check()
        return json_response({"model": pipeline.name, "plan": pipeline.plan,
                              **await faces_of(pipeline, found, attention, start)})
    # several photos: every one's faces found first (detection stops once the request's budget is spent, a 413
    # before any batch), then each photo's faces in a batch of their own (which the batcher merges with the others')
    found = await asyncio.gather(*(pipeline.find_faces(data, detect, detector, budget) for _, _, data in uploads),
                                 return_exceptions=True)
    if budget.spent:  # refused: what its photos' decodes and detections took back to the system, not kept at its peak
        await asyncio.get_running_loop().run_in_executor(pipeline.decode_pool, release_memory)
    budget.check()
    raise_for_request(found)

    async def answer(photo: FoundFaces | BaseException) -> dict:
        if isinstance(photo, BaseException):
            raise photo
        return await faces_of(pipeline, photo, attention, start)

    answers = await asyncio.gather(*map(answer, found), return_exceptions=True)
    raise_for_request(answers)
    results = [{"filename": filename, "error": {"code": a.code, "message": a.message}} if isinstance(a, Exception)
               else {"filename": filename, **a} for (_, filename, _), a in zip(uploads, answers)]
    return json_response({"model": pipeline.name, "plan": pipeline.plan, "results": results})


def raise_for_request(answers: list) -> None:
    """The request's error, where a photo failed otherwise than by its own file (the deadline, overload), or where
    none could be read."""
    failed = [a for a in answers if isinstance(a, BaseException) and not isinstance(a, IMAGE_ERRORS)]
    if failed:
        raise failed[0]
    if all(isinstance(a, BaseException) for a in answers):
        raise answers[0]


async def faces_of(pipeline: Pipeline, photo: FoundFaces, attention: bool, start: float) -> dict:
    """One photo's answer: its size, its faces with their expressions, and the timings."""
    out = await pipeline.run_faces(photo, for_maps=attention)
    size, found = photo.size, photo.found
    labels, faces = pipeline.entry.labels, []
    for i, (probs, batch) in enumerate(zip(Classifier.scored(out.fields), out.batch_size) if len(out) else ()):
        key = await pipeline.store_attention(out, i) if attention else None
        best = int(probs.argmax())
        faces.append({"id": key or uuid.uuid4().hex, **(face_geometry(found, i, pipeline) if found else
                                                         {"box": [0, 0, *size], "landmarks": None,
                                                          "detection_score": None}),
                      "expression": labels[best], "score": float(probs[best]),
                      "probabilities": dict(zip(labels, probs.tolist())), "batch_size": int(batch),
                      "attention_map_url": f"/attention-map?id={key}" if key else None})
    timings = {"decode_detect_ms": photo.found_ms, "queue_ms": float(out.queue_ms.max()) if faces else 0.0,
               "inference_ms": float(out.inference_ms.max()) if faces else 0.0,
               "total_ms": (time.perf_counter() - start) * 1e3}
    return {"image_size": list(size), "faces": faces, "timings_ms": timings}


def face_geometry(found: Faces, i: int, pipeline: Pipeline) -> dict:
    """Face i's box [x, y, w, h] (whole pixels), landmarks by name ([x, y], to a tenth of a pixel) and score."""
    x0, y0, x1, y1 = np.rint(found.boxes[i]).astype(int).tolist()
    names = pipeline.detector.landmark_names
    return {"box": [x0, y0, x1 - x0, y1 - y0],
            "landmarks": {name: np.round(point, 1).tolist() for name, point in zip(names, found.landmarks[i])},
            "detection_score": round(float(found.scores[i]), 4)}
