"""The Open Inference Protocol (KServe v2) subset that Triton's clients use, over the same pipelines and batchers.

Tensors travel as JSON `data` lists or, with the binary tensor extension (tritonclient's default), as raw
little-endian bytes after the JSON header, whose length is in the Inference-Header-Content-Length header.
One input per request, either of the graph's two:
  pixel_values  FP32 [B, 3, H, W], already normalised, (x / 255 - mean) / std: the documented input, as before;
  images        UINT8 [B, H, W, 3], pixels at the input size: a quarter of the bytes, normalised in the graph.
Outputs (logits and attention outputs) come back as JSON, or as binary where the request asks for it
(`binary_data` per output, or `binary_data_output` for all): then no float is formatted as text.
Every answer is strict JSON: FP32 input that is not finite (NaN, infinity, or past FP32's range, as 1e39) is a
400, and an output value that is not finite (a model can overflow on huge finite input) is written as null.
"""
import json
from functools import cache
from importlib.metadata import version
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field, ValidationError

from ..errors import BadInput, NotFound
from ..pipeline import Pipeline, Pipelines
from ..records import output_names

router = APIRouter(prefix="/v2", tags=["kserve-v2"])
HEADER_LENGTH = "Inference-Header-Content-Length"
DATATYPES = {"FP32": np.dtype("<f4"), "UINT8": np.dtype("u1")}


def _pipelines(request: Request) -> Pipelines:
    return request.app.state.pipelines


def _model(request: Request, name: str, version_: str | None) -> Pipeline:
    pipelines = _pipelines(request)
    if name not in pipelines.pipelines or version_ not in (None, "1"):
        raise NotFound(f"no model {name!r}" + (f" version {version_}" if version_ else ""), "model_not_found")
    return pipelines.pipelines[name]


class InputParameters(BaseModel):
    binary_data_size: int | None = Field(None, ge=0)


class RequestInput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: Any = None  # JSON numbers, flat or nested; absent when the tensor travels as binary
    parameters: InputParameters = InputParameters()


class OutputParameters(BaseModel):
    binary_data: bool | None = None


class RequestOutput(BaseModel):
    name: str
    parameters: OutputParameters = OutputParameters()


class RequestParameters(BaseModel):
    binary_data_output: bool = False


class InferenceRequest(BaseModel):
    """The request's JSON (the binary tensors that may follow it are not part of it)."""
    id: str | None = None
    inputs: list[RequestInput] = Field(min_length=1, max_length=1)
    outputs: list[RequestOutput] | None = None
    parameters: RequestParameters = RequestParameters()


def _json_end(body: bytes, header_length: str | None) -> int:
    if header_length is None:
        return len(body)
    if not (header_length.isascii() and header_length.isdigit()) or int(header_length) > len(body):
        raise BadInput(f"{HEADER_LENGTH} {header_length!r} is not the length of the JSON that starts the body "
                       f"({len(body)} bytes)")
    return int(header_length)


def parse_request(body: bytes, header_length: str | None, inputs: list[dict]) -> tuple[InferenceRequest, np.ndarray]:
    """The request's JSON header and its one input batch, checked against the model's `inputs` (metadata).
    Pydantic's JSON parser bounds the nesting (a body nested 5,000 deep is a 400, not a RecursionError)."""
    json_end = _json_end(body, header_length)
    try:
        header = InferenceRequest.model_validate_json(body[:json_end])
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadInput("expected a JSON body with exactly one input tensor {name, shape, datatype, data}: "
                       + f"{where}: {first['msg']}".strip(": ")) from None
    tensor = header.inputs[0]
    name, shape, datatype = tensor.name, tensor.shape, tensor.datatype
    wanted = next((i for i in inputs if i["name"] == name), None)
    if wanted is None or wanted["datatype"] != datatype:
        raise BadInput(f"input {name!r} {datatype}; this model takes "
                       + " or ".join(f"{i['name']!r} {i['datatype']} {i['shape']}" for i in inputs))
    if len(shape) != 4 or shape[1:] != wanted["shape"][1:] or shape[0] < 1:
        raise BadInput(f"input shape {shape}; this model takes {wanted['shape']} for {datatype}")
    count, dtype = int(np.prod(shape)), DATATYPES[datatype]
    size = tensor.parameters.binary_data_size
    try:
        if size is not None:
            data = np.frombuffer(body[json_end:json_end + size], dtype=dtype)
        else:
            with np.errstate(over="ignore"):  # past FP32's range becomes inf, refused below
                data = np.asarray(tensor.data, dtype=dtype).ravel()
    except (ValueError, TypeError, OverflowError):
        raise BadInput("input data is missing or not numbers") from None
    if data.size != count:
        raise BadInput(f"input has {data.size} values for shape {shape} ({count})")
    if datatype == "FP32" and not np.isfinite(data).all():
        raise BadInput("input has values that are not finite (NaN, infinity, or past FP32's range)", "non_finite")
    return header, data.reshape(shape)


def json_numbers(value: np.ndarray) -> list:
    """A flat list for JSON, non-finite values as null (as JavaScript's JSON.stringify does): JSON has no NaN,
    and a model can overflow on finite input."""
    flat = value.ravel()
    if np.isfinite(flat).all():
        return flat.tolist()
    return np.where(np.isfinite(flat), flat, None).tolist()


def build_response(pipeline: Pipeline, header: InferenceRequest, outputs: dict[str, np.ndarray]) -> Response:
    """JSON, or JSON header + raw bytes for the outputs asked for in binary."""
    asked = header.outputs or [RequestOutput(name=name) for name in outputs]
    tensors, blobs = [], []
    for out in asked:
        if out.name not in outputs:
            raise BadInput(f"no output {out.name!r}; outputs: {', '.join(outputs)}")
        value = np.ascontiguousarray(outputs[out.name], dtype="<f4")
        tensor = {"name": out.name, "datatype": "FP32", "shape": list(value.shape)}
        binary = out.parameters.binary_data
        if header.parameters.binary_data_output if binary is None else binary:
            blobs.append(value.tobytes())
            tensor["parameters"] = {"binary_data_size": len(blobs[-1])}
        else:
            tensor["data"] = json_numbers(value)
        tensors.append(tensor)
    body = {"model_name": pipeline.name, "model_version": "1", "outputs": tensors}
    if header.id is not None:
        body["id"] = header.id
    encoded = json.dumps(body).encode()
    if not blobs:
        return Response(encoded, media_type="application/json")
    return Response(encoded + b"".join(blobs), media_type="application/octet-stream",
                    headers={HEADER_LENGTH: str(len(encoded))})


INFER = {"summary": "Run the model on one input tensor",
         "description": "JSON `{\"inputs\": [{\"name\", \"shape\", \"datatype\", \"data\"}], \"outputs\": [...]}`, or "
                        "the binary tensor extension (raw bytes after the JSON, its length in the "
                        "Inference-Header-Content-Length header). Inputs: `pixel_values` FP32 [B, 3, H, W], "
                        "normalised as `parameters.preprocessing` of the model metadata says, or `images` UINT8 "
                        "[B, H, W, 3] (the graph normalises). Outputs: logits and the attention outputs. "
                        "`tritonclient.http` works as is.",
         "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": {
             "type": "object", "required": ["inputs"], "properties": {
                 "inputs": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
                     "type": "object", "required": ["name", "shape", "datatype"], "properties": {
                         "name": {"type": "string", "example": "images"},
                         "shape": {"type": "array", "items": {"type": "integer"}, "example": [1, 96, 96, 3]},
                         "datatype": {"type": "string", "enum": ["FP32", "UINT8"]},
                         "data": {"type": "array", "items": {"type": "number"}},
                         "parameters": {"type": "object"}}}},
                 "outputs": {"type": "array", "items": {"type": "object", "properties": {
                     "name": {"type": "string"}, "parameters": {"type": "object"}}}},
                 "parameters": {"type": "object"}, "id": {"type": "string"}}}}}}}}


# the inference route first: routes are matched in order, and this one carries the load
@router.post("/models/{name}/infer", **INFER)
async def infer(request: Request, name: str) -> Response:
    return await infer_version(request, name, None)


@router.post("/models/{name}/versions/{version_}/infer", **INFER)
async def infer_version(request: Request, name: str, version_: str | None) -> Response:
    _model(request, name, version_)
    pipeline = _pipelines(request).get(name)
    header, batch = parse_request(await request.body(), request.headers.get(HEADER_LENGTH),
                                  model_metadata(pipeline)["inputs"])
    out = await pipeline.tensors(batch)
    return build_response(pipeline, header, {k: out.fields[k] for k in output_names(pipeline.entry)})


@router.get("", summary="Server metadata")
async def server_metadata() -> dict:
    return {"name": "vitserve", "version": version("vitserve"), "extensions": ["binary_tensor_data"]}


@router.get("/health/live", summary="200 while the server runs")
async def live() -> dict:
    return {"live": True}


@router.get("/health/ready", summary="200 once every model is loaded or failed and one serves, 400 before")
async def ready(request: Request) -> dict:
    if not _pipelines(request).ready:
        raise BadInput("the server is still loading its models", "not_ready")  # v2: 4xx means false
    return {"ready": True}


@cache  # read on every infer request; the same for the pipeline's lifetime
def model_metadata(pipeline: Pipeline) -> dict:
    """The model's inputs (send one of them) and outputs."""
    m = pipeline.entry.manifest
    h, w = m["input"]["size"]
    return {
        "name": pipeline.name, "versions": ["1"], "platform": "onnxruntime_onnx",
        "parameters": {"preprocessing": pipeline.entry.preprocessing},  # how to make `pixel_values` from a photo
        "inputs": [{"name": m["tensor_input"]["name"], "datatype": "FP32", "shape": [-1, 3, h, w]},
                   {"name": m["input"]["name"], "datatype": "UINT8", "shape": [-1, h, w, 3]}],
        "outputs": [{"name": o["name"], "datatype": "FP32", "shape": [-1 if d == "batch" else d for d in o["shape"]]}
                    for o in m["outputs"]],
    }


METADATA = {"summary": "Model metadata: inputs, outputs and preprocessing"}
READY = {"summary": "200 once this model serves, 400 before or after it failed"}


# each route once with and once without its version, so that neither lists a parameter it does not have
@router.get("/models/{name}", **METADATA)
async def metadata(request: Request, name: str) -> dict:
    return await metadata_version(request, name, None)


@router.get("/models/{name}/versions/{version_}", **METADATA)
async def metadata_version(request: Request, name: str, version_: str | None) -> dict:
    return model_metadata(_model(request, name, version_))


@router.get("/models/{name}/ready", **READY)
async def model_ready(request: Request, name: str) -> dict:
    return await model_ready_version(request, name, None)


@router.get("/models/{name}/versions/{version_}/ready", **READY)
async def model_ready_version(request: Request, name: str, version_: str | None) -> dict:
    status = _pipelines(request).backend.status()[_model(request, name, version_).name]
    if not status.ready:
        raise BadInput(f"{name} is not ready" + (f": {status.error}" if status.error else ""), "not_ready")
    return {"name": name, "ready": True}
