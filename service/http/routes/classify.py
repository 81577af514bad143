"""POST /classify: one image (`file`) or several (`files`, each its own batch item) -> top-k labels: the model's own
classes, or (zero-shot, a whole CLIP) the labels the request names, scored by their prompts' text vectors."""
import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, Field

from service.core.urgency import PRIORITY, TIMEOUT_MS, from_query
from service.core.errors import BadInput
from service.engine.heads import OUTPUTS_ONLY, Classifier
from service.pipeline.pipeline import Pipeline, Results
from service.pipeline.served import Pipelines

from ..schemas import ClassifyResponse
from .responses import batch_and_timings, json_response
from .uploads import form_parts, images_of, texts_of, upload_body

router = APIRouter(tags=["inference"])


class ClassifyQuery(BaseModel):
    """The query of POST /classify, as FastAPI documents it and hot_routes.py checks it."""
    model: str | None = Field(None, description="model name (default: the server's default model)")
    top_k: int = Field(5, ge=1, le=100, description="how many labels per image")
    attention: bool = Field(False, description="keep the attention maps for GET /attention-map")
    labels: list[str] | None = Field(None, description="zero-shot: the labels to score, this parameter repeated "
                                                       "(labels=cat&labels=dog), of a model with a text tower "
                                                       "(a whole CLIP)")
    template: str | None = Field(None, description="zero-shot: the prompt, its {} taking each label (default: the "
                                                   "model's, e.g. 'a photo of a {}.')")
    timeout_ms: int | None = Field(None, ge=1, le=3_600_000, description=TIMEOUT_MS)
    priority: int | None = Field(None, ge=0, le=100, description=PRIORITY)


def predictions(pipeline: Pipeline, out: Results, top_k: int) -> list[list[dict]]:
    """Per image, its top-k labels, best first (top-k itself was computed once for the whole batch)."""
    labels, (index, score) = pipeline.entry.labels, Classifier.best(out.fields, top_k)
    return [[{"label": labels[i], "index": i, "score": s} for i, s in zip(*best)]
            for best in zip(index.tolist(), score.tolist())]


@router.post(
    "/classify", response_model=ClassifyResponse,
    summary="Classify one or several images",
    description="Multipart upload: one image as `file`, or several as `files` (each its own batch item). "
                "Example: `curl -F file=@cat.jpg 'localhost:8000/classify?top_k=5'`.",
    responses={400: {"description": "no image, or an image that cannot be decoded (of several, only where none "
                                    "can: the others are answered, and it gets an `error` of its own)"},
               404: {"description": "unknown model"}, 413: {"description": "upload or image too large, or more images "
                                                                  "than the limit or the model's queue holds"},
               415: {"description": "not an image"}, 503: {"description": "overloaded or still loading"},
               504: {"description": "past the request's timeout_ms"}},
    openapi_extra=upload_body({"file": "one image (JPEG, PNG, WebP, ...)"}, several="files",
                              texts={"labels": "zero-shot labels, this field repeated (or the query's labels)"}),
)
async def classify(request: Request, query: Annotated[ClassifyQuery, Query()]) -> Response:
    start = time.perf_counter()
    model, top_k, attention = query.model, query.top_k, query.attention
    pipelines: Pipelines = request.app.state.pipelines
    from_query(start, query.timeout_ms, query.priority, pipelines.settings.priority_levels)

    labels: list[str] | None = None  # zero-shot: the query's labels, or the form's
    prompts: list[str] | None = None

    async def read(chosen: Pipeline) -> list[tuple[str | None, bytes]]:
        nonlocal labels, prompts
        parts = await form_parts(request)
        form_labels = texts_of(parts, "labels")
        if query.labels is not None and form_labels:
            raise BadInput("labels both in the query and in the form: send them in one", "labels_twice")
        labels = query.labels if query.labels is not None else form_labels or None
        if labels is None and query.template is not None:
            raise BadInput("template without labels: it is the prompt of zero-shot labels (labels=...)", "no_labels")
        if labels is not None:
            prompts = chosen.text_tower().prompts(labels, query.template)
            chosen.check_embedding()
        else:
            chosen.check_classifier()
        if attention:
            chosen.check_attention()
        return [(filename, data) for _, filename, data in images_of(parts, ("file", "files"),
                                                                    pipelines.settings.max_files)]

    pipeline, uploads = await pipelines.routed(read, model)
    images = [data for _, data in uploads]
    if prompts is None:
        out = await pipeline.images(images, top_k, for_maps=attention)
        answers, scores = predictions(pipeline, out, top_k), pipeline.entry.scores
    else:
        tower = pipeline.text_tower()
        vectors = await tower.label_vectors(prompts)
        out = await pipeline.images(images, OUTPUTS_ONLY, for_maps=attention)
        answers = tower.zero_shot(out.fields[pipeline.entry.embedding["output"]], labels, vectors, top_k)
        scores = tower.scores
    total_ms = (time.perf_counter() - start) * 1e3
    results = []
    for i, ((filename, _), top, ran) in enumerate(zip(uploads, answers, batch_and_timings(out, total_ms))):
        if (error := out.errors.get(i)) is not None:  # this file alone could not be read
            results.append({"filename": filename, "error": {"code": error.code, "message": error.message}})
            continue
        key = await pipeline.store_attention(out, i) if attention else None
        results.append({"id": key or uuid.uuid4().hex, "filename": filename, "predictions": top, **ran,
                        "attention_map_url": f"/attention-map?id={key}" if key else None})
    return json_response({"model": pipeline.name, "plan": pipeline.plan, "scores": scores, "results": results})
