"""The Open Inference Protocol (KServe v2) subset that Triton's clients use, over the same batchers.

Tensors travel as JSON `data` lists or, with the binary tensor extension (tritonclient's default), as raw
little-endian bytes after the JSON header, whose length is in the Inference-Header-Content-Length header.
Only FP32 pixel batches [B, 3, H, W] in; the model's outputs (logits and attention outputs) out.
"""
import json
from importlib.metadata import version

import numpy as np
from fastapi import APIRouter, Request, Response

from ..errors import APIError
from ..pool import ModelPool, ServedModel

router = APIRouter(prefix="/v2", tags=["kserve-v2"])
HEADER_LENGTH = "Inference-Header-Content-Length"


def _pool(request: Request) -> ModelPool:
    return request.app.state.pool


def _model(request: Request, name: str, version_: str | None = None) -> ServedModel:
    pool = _pool(request)
    if name not in pool.models or version_ not in (None, "1"):
        raise APIError(404, "model_not_found", f"no model {name!r}" + (f" version {version_}" if version_ else ""))
    return pool.models[name]


@router.get("", summary="Server metadata")
async def server_metadata() -> dict:
    return {"name": "vitserve", "version": version("vitserve"), "extensions": ["binary_tensor_data"]}


@router.get("/health/live")
async def live() -> dict:
    return {"live": True}


@router.get("/health/ready")
async def ready(request: Request) -> dict:
    if not _pool(request).ready:
        raise APIError(400, "not_ready", "the server is still loading its models")  # v2: 4xx means false
    return {"ready": True}


def model_metadata(served: ServedModel) -> dict:
    m = served.entry.manifest
    shape = [-1, 3, *m["input"]["size"]]
    return {
        "name": served.name, "versions": ["1"], "platform": "onnxruntime_onnx",
        "inputs": [{"name": m["input"]["name"], "datatype": "FP32", "shape": shape}],
        "outputs": [{"name": o["name"], "datatype": "FP32", "shape": [-1 if d == "batch" else d for d in o["shape"]]}
                    for o in m["outputs"]],
    }


@router.get("/models/{name}")
@router.get("/models/{name}/versions/{version_}")
async def metadata(request: Request, name: str, version_: str | None = None) -> dict:
    return model_metadata(_model(request, name, version_))


@router.get("/models/{name}/ready")
@router.get("/models/{name}/versions/{version_}/ready")
async def model_ready(request: Request, name: str, version_: str | None = None) -> dict:
    served = _model(request, name, version_)
    if not served.ready:
        raise APIError(400, "not_ready", f"{name} is not ready" + (f": {served.error}" if served.error else ""))
    return {"name": name, "ready": True}


def parse_request(body: bytes, header_length: str | None, expected_shape: list[int]) -> tuple[dict, np.ndarray]:
    """The request's JSON header and its FP32 pixel batch, checked against the model's input shape."""
    json_end = int(header_length) if header_length else len(body)
    try:
        header = json.loads(body[:json_end])
        (tensor,) = header["inputs"]
        shape, datatype = [int(d) for d in tensor["shape"]], tensor["datatype"]
    except (ValueError, KeyError, TypeError):
        raise APIError(400, "bad_request", "expected a JSON body with exactly one input tensor "
                                           "{name, shape, datatype, data}") from None
    if datatype != "FP32":
        raise APIError(400, "bad_request", f"input datatype {datatype}; this model takes FP32")
    if len(shape) != 4 or shape[1:] != expected_shape[1:] or shape[0] < 1:
        raise APIError(400, "bad_request", f"input shape {shape}; this model takes {expected_shape}")
    count = int(np.prod(shape))
    size = tensor.get("parameters", {}).get("binary_data_size")
    try:
        if size is not None:
            data = np.frombuffer(body[json_end:json_end + int(size)], dtype="<f4")
        else:
            data = np.asarray(tensor["data"], dtype=np.float32).ravel()
    except (KeyError, ValueError, TypeError):
        raise APIError(400, "bad_request", "input data is missing or not numbers") from None
    if data.size != count:
        raise APIError(400, "bad_request", f"input has {data.size} values for shape {shape} ({count})")
    return header, data.reshape(shape).astype(np.float32)


def build_response(served: ServedModel, header: dict, outputs: dict[str, np.ndarray]) -> Response:
    """JSON, or JSON header + raw bytes for the outputs asked for in binary."""
    asked = header.get("outputs") or [{"name": name} for name in outputs]
    default_binary = header.get("parameters", {}).get("binary_data_output", False)
    tensors, blobs = [], []
    for out in asked:
        if out.get("name") not in outputs:
            raise APIError(400, "bad_request", f"no output {out.get('name')!r}; outputs: {', '.join(outputs)}")
        value = np.ascontiguousarray(outputs[out["name"]], dtype="<f4")
        tensor = {"name": out["name"], "datatype": "FP32", "shape": list(value.shape)}
        if out.get("parameters", {}).get("binary_data", default_binary):
            blobs.append(value.tobytes())
            tensor["parameters"] = {"binary_data_size": len(blobs[-1])}
        else:
            tensor["data"] = value.ravel().tolist()
        tensors.append(tensor)
    body = {"model_name": served.name, "model_version": "1", "outputs": tensors}
    if "id" in header:
        body["id"] = header["id"]
    encoded = json.dumps(body).encode()
    if not blobs:
        return Response(encoded, media_type="application/json")
    return Response(encoded + b"".join(blobs), media_type="application/octet-stream",
                    headers={HEADER_LENGTH: str(len(encoded))})


@router.post("/models/{name}/infer")
@router.post("/models/{name}/versions/{version_}/infer")
async def infer(request: Request, name: str, version_: str | None = None) -> Response:
    pool = _pool(request)
    _model(request, name, version_)
    served = pool.get(name)
    expected = model_metadata(served)["inputs"][0]["shape"]
    header, batch = parse_request(await request.body(), request.headers.get(HEADER_LENGTH), expected)
    results = await pool.infer(served, list(batch))
    outputs = {k: np.stack([r.outputs[k] for r in results]) for k in results[0].outputs}
    return build_response(served, header, outputs)
