"""Triton's system shared-memory extension over REST (the regions themselves: shared_memory.py): register a region
of a /dev/shm file under a name, see what is registered, unregister. With an API key set, these need it, as /infer
does; they answer 403 to a client not on this host (VITSERVE_SHARED_MEMORY=local, the default) and, with
VITSERVE_SHARED_MEMORY=false, to every client. CUDA shared memory is not offered: its status lists nothing and its
unregister has nothing to do (perf_analyzer unregisters both kinds as it ends), its register is a 400."""
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, ValidationError

from service.core.errors import BadInput
from service.engine.shared_memory import NO_CUDA_SHARED_MEMORY, no_cuda_region
from service.protocol.open_inference import regions_backend

router = APIRouter(prefix="/v2/systemsharedmemory", tags=["system shared memory"])
cuda_router = APIRouter(prefix="/v2/cudasharedmemory", tags=["system shared memory"])


class RegionRequest(BaseModel):
    key: str = Field(description="the shm_open name of a file in /dev/shm, as /NAME", examples=["/input0"])
    offset: int = Field(0, ge=0, description="where the region starts in the file")
    byte_size: int = Field(gt=0)


class RegionStatus(RegionRequest):
    name: str


def client_host(request: Request) -> str | None:
    """The client's address; None for a Unix-socket peer, the one kind uvicorn gives none for. Behind a proxy on
    this host, the address its X-Forwarded-For gives (uvicorn trusts it from FORWARDED_ALLOW_IPS: 127.0.0.1, ::1)."""
    return request.client.host if request.client else None


def _backend(request: Request):
    return regions_backend(request.app.state.pipelines, client_host(request))


# the body is read whatever its Content-Type (tritonclient sends none), and a bad one is a 400, as under all of /v2
@router.post("/region/{name}/register", summary="Register a region of a /dev/shm file under a name",
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                 "schema": RegionRequest.model_json_schema()}}}})
async def register(request: Request, name: str) -> dict:
    try:
        region = RegionRequest.model_validate_json(await request.body())
    except ValidationError as e:
        first = e.errors()[0]
        raise BadInput("expected a JSON body {key, offset, byte_size}: "
                       + f"{'.'.join(map(str, first['loc']))}: {first['msg']}".strip(": ")) from None
    await _backend(request).register_region(name, region.key, region.offset, region.byte_size)
    return {}


@router.post("/unregister", summary="Unregister every region (400 while a request uses one)")
async def unregister_all(request: Request) -> dict:
    return await unregister(request, "")


@router.post("/region/{name}/unregister", summary="Unregister a region (400 while a request uses it)")
async def unregister(request: Request, name: str) -> dict:
    await _backend(request).unregister_region(name)
    return {}


@router.get("/status", response_model=list[RegionStatus], summary="Every region registered")
async def status_all(request: Request) -> list[dict]:
    return await status(request, "")


@router.get("/region/{name}/status", response_model=list[RegionStatus], summary="A region, if it is registered")
async def status(request: Request, name: str) -> list[dict]:
    return await _backend(request).region_status(name)


@cuda_router.post("/region/{name}/register", summary="Not offered: a 400")
async def cuda_register(name: str) -> dict:
    raise BadInput(NO_CUDA_SHARED_MEMORY)


@cuda_router.post("/unregister", summary="Nothing to unregister")
async def cuda_unregister_all() -> dict:
    return {}


@cuda_router.post("/region/{name}/unregister", summary="Nothing to unregister")
async def cuda_unregister(name: str) -> dict:
    return {}


@cuda_router.get("/status", summary="No region registered")
async def cuda_status() -> list:
    return []


@cuda_router.get("/region/{name}/status", summary="No region registered: a 400")
async def cuda_region_status(name: str) -> list:
    raise no_cuda_region(name)
