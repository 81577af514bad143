"""GET /models: what is served, how, and whether it is ready."""
from fastapi import APIRouter, Request

from ..pool import ModelPool, ServedModel
from ..schemas import ModelInfo, ModelsResponse

router = APIRouter(tags=["models"])


def model_info(served: ServedModel) -> ModelInfo:
    m = served.entry.manifest
    return ModelInfo(
        name=served.name, architecture=m["architecture"], family=m["family"], task=m["task"], labels=m["labels"],
        input_size=m["input"]["size"], precision=m["precision"],
        provider=served.runner.provider if served.runner else None, ready=served.ready, error=served.error,
        attention=m["attention"], explain=served.entry.has("explain"), parity=m["parity"])


@router.get("/models", response_model=ModelsResponse, summary="The served models")
async def list_models(request: Request) -> ModelsResponse:
    pool: ModelPool = request.app.state.pool
    return ModelsResponse(default_model=pool.default_model, models=[model_info(m) for m in pool.models.values()],
                          not_served=pool.problems)
