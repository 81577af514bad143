"""The Open Inference Protocol's model repository extension, as Triton's explicit model control speaks it: the
repository's models with their state, and a model (re)loaded or unloaded while the others, and it, keep serving.

Load and unload answer only with VITSERVE_MODEL_CONTROL=explicit (403 otherwise); the index always answers.
With an API key set, all three need it, as every route does but health and metrics.
"""
import json

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from service.core.errors import BadInput
from service.pipeline.served import Pipelines
from service.protocol.open_inference import check_load_parameters, repository_index, require_model_control

router = APIRouter(prefix="/v2/repository", tags=["model repository"])


class ModelState(BaseModel):
    name: str
    version: str | None = None
    state: str = Field(description="READY, LOADING or UNAVAILABLE")
    reason: str = Field(description="why it is unavailable, or why its last load failed while the old one serves")


async def _json(request: Request) -> dict:
    """The request's JSON object; an empty body is an empty object (tritonclient sends none for the index)."""
    body = await request.body()
    try:
        parsed = json.loads(body) if body.strip() else {}
    except ValueError:
        raise BadInput("the body is not JSON", "bad_json") from None
    if not isinstance(parsed, dict):
        raise BadInput("the body must be a JSON object", "bad_json")
    return parsed


@router.post("/index", response_model=list[ModelState], summary="The repository's models and their state")
async def index(request: Request) -> list[dict]:
    return await repository_index(request.app.state.pipelines, (await _json(request)).get("ready") is True)


@router.post("/models/{name}/load", summary="Load or reload a model from its folder, without a request lost")
async def load(request: Request, name: str) -> dict:
    pipelines: Pipelines = request.app.state.pipelines
    require_model_control(pipelines)
    check_load_parameters((await _json(request)).get("parameters") or {})
    await pipelines.backend.models.load(name)
    return {}


@router.post("/models/{name}/unload", summary="Stop serving a model once the requests it accepted are answered")
async def unload(request: Request, name: str) -> dict:
    pipelines: Pipelines = request.app.state.pipelines
    require_model_control(pipelines)
    await _json(request)  # unload_dependents: a model here has none
    await pipelines.backend.models.unload(name)
    return {}
