"""GET /attention-map (a result kept by /classify?attention=true) and POST /attention-map (an image)."""
import asyncio
import json
from typing import Literal

import numpy as np
from fastapi import APIRouter, Depends, File, Query, Request, Response, UploadFile

from .. import attention as maps
from ..cache import AttentionRecord
from ..errors import APIError
from ..pool import ModelPool, ServedModel
from ..preprocess import decode, prepare
from .classify import read_uploads, run_images, top_k

router = APIRouter(tags=["attention"])
PNG_EXAMPLE = {"image/png": {}, "application/json": {}}


class MapOptions:
    def __init__(
        self,
        method: Literal["last", "rollout"] = Query("last", description="last block, or rollout over all blocks"),
        head: str = Query("mean", pattern=r"^(mean|max|\d+)$", description="mean, max or a head index"),
        token: Literal["cls", "dist", "both"] = Query("cls", description="distilled DeiT: whose row"),
        format: Literal["png", "json"] = Query("png"),
        overlay: bool = Query(True, description="PNG: over the photo, or the heat map alone"),
        alpha: float = Query(0.5, ge=0.0, le=1.0, description="PNG overlay opacity"),
        colormap: str = Query("jet", description="jet, turbo, viridis, inferno, magma, gray"),
    ):
        self.method, self.head, self.token, self.format = method, head, token, format
        self.overlay, self.alpha, self.colormap = overlay, alpha, colormap


async def render(pool: ModelPool, served: ServedModel, outputs: dict[str, np.ndarray], image_bytes: bytes,
                 options: MapOptions, extra: dict | None = None) -> Response:
    attention, policy = served.entry.manifest["attention"], served.entry.policy
    if options.method == "rollout":
        x, _ = await asyncio.get_running_loop().run_in_executor(
            pool.decode, prepare, image_bytes, policy, pool.settings.max_image_pixels)
        grid = maps.rollout_grid(await pool.explain(served, x), attention, options.token, options.head)
    else:
        grid = maps.last_layer_grid(outputs, attention, options.token, options.head)
    image = await asyncio.get_running_loop().run_in_executor(
        pool.decode, decode, image_bytes, None, pool.settings.max_image_pixels)
    box = maps.crop_box(image.size, policy)
    if options.format == "json":
        return Response(content=json.dumps({
            "model": served.name, "method": options.method, "head": options.head,
            "token": None if "received" in attention["outputs"] else options.token,
            "grid_size": list(grid.shape), "grid": np.round(grid.astype(np.float64), 4).tolist(),
            "image_size": list(image.size),
            "crop_box": [round(v, 2) for v in box], **(extra or {})}), media_type="application/json")
    png = await asyncio.get_running_loop().run_in_executor(
        pool.decode, maps.render_png, image, grid, box, options.overlay, options.alpha, options.colormap)
    return Response(png, media_type="image/png")


@router.get("/attention-map", summary="The attention map of an earlier /classify?attention=true image",
            responses={200: {"content": PNG_EXAMPLE}, 404: {"description": "unknown or expired id"}},
            description="Example: `curl 'localhost:8000/attention-map?id=<id>' -o map.png`.")
async def attention_map(request: Request, id: str = Query(..., description="an image id from /classify"),
                        options: MapOptions = Depends()) -> Response:
    pool: ModelPool = request.app.state.pool
    record: AttentionRecord | None = request.app.state.attention_cache.get(id)
    if record is None:
        ttl = pool.settings.attention_ttl_s
        raise APIError(404, "attention_not_found", f"no attention result with id {id!r}: it expired (results are "
                                                   f"kept {ttl:g}s, and the least recently used go first when the "
                                                   "cache is full) or never existed; classify with attention=true")
    return await render(pool, pool.get(record.model), record.attention, record.image, options)


@router.post("/attention-map", summary="Classify one image and return its attention map",
             responses={200: {"content": PNG_EXAMPLE}},
             description="Example: `curl -F file=@cat.jpg 'localhost:8000/attention-map?method=rollout' -o map.png`.")
async def attention_map_for_image(
    request: Request,
    file: UploadFile = File(..., description="one image"),
    model: str | None = Query(None, description="model name (default: the server's default model)"),
    options: MapOptions = Depends(),
) -> Response:
    pool: ModelPool = request.app.state.pool
    served = pool.get(model)
    ((_, data),) = await read_uploads([file], 1)
    _, _, (result,) = await run_images(pool, served, [data])
    top = top_k(result.outputs["logits"], served.entry.labels, 1)[0]
    response = await render(pool, served, result.outputs, data, options, {"prediction": top.model_dump()})
    response.headers["X-Prediction"] = f"{top.label} {top.score:.4f}"
    return response
