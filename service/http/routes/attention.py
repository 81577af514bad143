"""GET /attention-map (a result kept by /classify?attention=true) and POST /attention-map (an image).

Maps come from what the request kept: the attention outputs, and the model input for rollout and for relevance (the
class-specific map of one label, run on the relevance graph in a batch with other requests' maps). A PNG is drawn
over the upload at its own size, bounded by `max_side`: over the photo as the request decoded it, or, where that
decode was reduced (a JPEG's draft mode, for the model's small input), over the upload decoded again, once, at
the size the PNG needs, only when a PNG is asked for.
"""
import asyncio
import math
import time
from typing import Literal

import numpy as np
from fastapi import APIRouter, Depends, Query, Request, Response

from repository import InputPolicy
from service.core.errors import BadInput, NotFound
from service.core.urgency import PRIORITY, TIMEOUT_MS, from_query
from service.engine.heads import OUTPUTS_ONLY, SCORES
from service.explain import maps
from service.explain.cache import AttentionResult
from service.images.decode import decode
from service.pipeline.pipeline import Pipeline
from service.pipeline.served import Pipelines

from .classify import predictions
from .responses import json_response
from .uploads import read_images, upload_body

router = APIRouter(tags=["attention"])
PNG_EXAMPLE = {"image/png": {}, "application/json": {}}


class MapOptions:
    def __init__(
        self,
        method: Literal["last", "rollout", "relevance"] = Query(
            "last", description="last block, rollout over all blocks, or relevance: why the model gives one label "
                                "(Chefer et al. 2021 for ViT/DeiT, Grad-CAM for Swin, CAM for CNNs: "
                                "docs/attention.md)"),
        head: str | None = Query(None, pattern=r"^(mean|max|\d+)$",
                                 description="last and rollout: mean (the default), max or a head index"),
        token: Literal["cls", "dist", "both"] = Query("cls", description="distilled DeiT: whose row"),
        label: str | None = Query(None, max_length=256, description="relevance: the label to explain (default: the "
                                                                     "image's top label)"),
        class_: int | None = Query(None, alias="class", description="relevance: the label to explain, by index"),
        format: Literal["png", "json"] = Query("png"),
        overlay: bool = Query(True, description="PNG: over the photo, or the heat map alone"),
        alpha: float = Query(0.5, ge=0.0, le=1.0, description="PNG overlay opacity"),
        colormap: str = Query("jet", description="jet, turbo, viridis, inferno, magma, gray"),
        max_side: int = Query(1024, ge=16, le=8192, description="PNG: its longest side at most this many pixels"),
    ):
        if method == "relevance" and head is not None:
            raise BadInput("head does not apply to method=relevance: its rule combines the heads", "bad_head")
        if method != "relevance" and (label is not None or class_ is not None):
            raise BadInput(f"label and class choose what method=relevance explains; method={method} is the same map "
                           "for every label", "bad_label")
        self.method, self.head, self.token, self.format = method, head or "mean", token, format
        self.label, self.class_ = label, class_
        self.overlay, self.alpha, self.colormap, self.max_side = overlay, alpha, colormap, max_side

    def target(self, pipeline: Pipeline) -> tuple[np.ndarray, int | None]:
        """The relevance target of these options on the pipeline's model (maps.relevance_target): a 400 before any
        work for a label it does not have."""
        return maps.relevance_target(pipeline.entry.labels, self.label, self.class_)


async def render(pipeline: Pipeline, record: AttentionResult, options: MapOptions, extra: dict | None = None,
                 headers: dict[str, str] | None = None) -> Response:
    attention, policy = pipeline.entry.attention, pipeline.policy
    pipeline.check_attention(options.method)
    own_token = attention is not None and "received" not in attention["outputs"]  # (not Swin's, nor a CNN's)
    if options.method == "relevance":
        target, index = options.target(pipeline)
        out = await pipeline.relevance(record.image[None], target[None])
        logits, rows = out.fields["logits"], out.fields["relevance"]
        index = int(np.argmax(logits[0])) if index is None else index  # (the graph's own choice: the first best)
        section = pipeline.entry.manifest["relevance"]
        grid = maps.relevance_grid(rows[0], section, options.token)
        score = float(SCORES[pipeline.entry.scores](logits)[0, index])
        extra = {"rule": section["rule"], "label": pipeline.entry.labels[index], "class": index,
                 "score": round(score, 6), **(extra or {})}
        headers = {"X-Relevance": f"{pipeline.entry.labels[index]} {score:.4f}", **(headers or {})}
        own_token = section["rows"] != ["grid"]
    elif options.method == "rollout":
        maps.check_rollout(attention)  # before running the explain graph
        layers = await pipeline.backend.explain(pipeline.key, record.image)
        grid = maps.rollout_grid(layers, attention, options.token, options.head)
    else:
        grid = maps.last_layer_grid(record.attention, attention, options.token, options.head)
    if options.format == "json":
        return json_response({
            "model": pipeline.name, "method": options.method,
            "head": None if options.method == "relevance" else options.head,
            "token": options.token if own_token else None,
            "grid_size": list(grid.shape), "grid": np.round(grid.astype(np.float64), 4).tolist(),
            "image_size": list(record.size), "crop_box": [round(v, 2) for v in policy.crop_box(*record.size)],
            **(extra or {})}, headers)
    png = await asyncio.get_running_loop().run_in_executor(  # decoding, scaling and encoding: off the event loop
        None, draw, record, grid, policy, options, pipeline.settings.max_image_pixels)
    return Response(png, media_type="image/png", headers=headers)


def draw(record: AttentionResult, grid: np.ndarray, policy: InputPolicy, options: MapOptions, max_pixels: int) -> bytes:
    """The PNG over the photo kept, or over the upload (a 1-D record.photo) decoded as reduced as it can be (a JPEG's
    draft mode) while its longest side stays at least max_side."""
    photo = record.photo
    if photo.ndim == 1:
        scale = min(1.0, options.max_side / max(record.size))
        photo = np.asarray(decode(photo.tobytes(), math.ceil(min(record.size) * scale), max_pixels).image)
    h, w = photo.shape[:2]
    return maps.render_png(photo, grid, policy.crop_box(w, h), options.overlay, options.alpha, options.colormap,
                           options.max_side)


@router.get("/attention-map", summary="The attention map of an earlier /classify?attention=true image",
            responses={200: {"content": PNG_EXAMPLE}, 404: {"description": "unknown or expired id"}},
            description="Example: `curl 'localhost:8000/attention-map?id=<id>' -o map.png`.")
async def attention_map(request: Request, id: str = Query(..., description="an image id from /classify"),
                        options: MapOptions = Depends()) -> Response:
    pipelines: Pipelines = request.app.state.pipelines
    record = await pipelines.backend.recall_attention(id)
    if record is None:
        ttl = pipelines.settings.attention_ttl_s
        raise NotFound(f"no attention result with id {id!r}: it expired (results are kept {ttl:g}s, and the least "
                       "recently used go first when the cache is full) or never existed; classify with "
                       "attention=true", "attention_not_found")
    pipeline = pipelines.keyed(record.model)
    if pipeline is None:
        raise NotFound(f"the attention result {id!r} expired with its model: {record.model} was unloaded",
                       "attention_not_found")
    return await render(pipeline, record, options)


@router.post("/attention-map", summary="Classify one image (or, on an embedding model, run it) and return its "
                                      "attention map",
             responses={200: {"content": PNG_EXAMPLE}, 504: {"description": "past the request's timeout_ms"}},
             description="Example: `curl -F file=@cat.jpg 'localhost:8000/attention-map?method=rollout' -o map.png`.",
             openapi_extra=upload_body({"file": "one image"}))
async def attention_map_for_image(
    request: Request,
    model: str | None = Query(None, description="model name (default: the server's default model)"),
    options: MapOptions = Depends(),
    timeout_ms: int | None = Query(None, ge=1, le=3_600_000, description=TIMEOUT_MS),
    priority: int | None = Query(None, ge=0, le=100, description=PRIORITY),
) -> Response:
    pipelines: Pipelines = request.app.state.pipelines
    from_query(time.perf_counter(), timeout_ms, priority, pipelines.settings.priority_levels)

    async def read(chosen: Pipeline) -> list[tuple[str | None, bytes]]:
        chosen.check_attention(options.method)  # a model without these maps fails before the body is read
        if options.method == "relevance":
            options.target(chosen)  # and a label it does not have
        return await read_images(request, ("file",), 1)

    pipeline, ((_, data),) = await pipelines.routed(read, model)
    # a model without a classifier (an embedding model, a task's own head) draws its map without a prediction
    out = await pipeline.images([data], top_k=1 if pipeline.classifies else OUTPUTS_ONLY, for_maps=True)
    record = pipeline.attention_result(out, 0)
    if not pipeline.classifies:
        return await render(pipeline, record, options)
    top = predictions(pipeline, out, 1)[0][0]
    return await render(pipeline, record, options, {"prediction": top},
                        {"X-Prediction": f"{top['label']} {top['score']:.4f}"})
