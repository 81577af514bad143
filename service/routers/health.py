"""Liveness and readiness, for load balancers and orchestrators (the /v2 forms are in kserve.py)."""
from fastapi import APIRouter, Request

from ..errors import APIError

router = APIRouter(tags=["health"])


def require_ready(request: Request) -> None:
    pool = request.app.state.pool
    if not pool.ready:
        waiting = [name for name, m in pool.models.items() if not (m.ready or m.error)]
        raise APIError(503, "not_ready", f"warming up: {', '.join(waiting) or 'no model could be loaded'}",
                       {"Retry-After": str(pool.settings.retry_after_s)})


@router.get("/health/live", summary="200 while the process runs")
async def live() -> dict:
    return {"status": "live"}


@router.get("/health/ready", summary="200 once every model is loaded and warm, 503 before")
async def ready(request: Request) -> dict:
    require_ready(request)
    return {"status": "ready"}
