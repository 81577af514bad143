"""Liveness and readiness, for load balancers and orchestrators (the /v2 forms are in kserve.py)."""
from fastapi import APIRouter, Request

from service.core.errors import Unavailable
from service.pipeline.served import Pipelines

router = APIRouter(tags=["health"])


def require_ready(request: Request) -> None:
    pipelines: Pipelines = request.app.state.pipelines
    if (problem := pipelines.backend.problem()) is not None:  # the inference process restarting, or hung
        raise problem
    if (why := pipelines.unready()) is not None:
        code, message = why
        raise Unavailable(message, code, pipelines.settings.retry_after_s)


@router.get("/health/live", summary="200 while this HTTP process runs (a restarting inference process is a readiness "
                                     "matter)")
async def live() -> dict:
    return {"status": "live"}


@router.get("/health/ready", summary="200 once every model of the repository serves, loaded and warm (with "
                                      "VITSERVE_STRICT_READINESS=false, once one does and none is loading); 503 else")
async def ready(request: Request) -> dict:
    require_ready(request)
    return {"status": "ready"}
