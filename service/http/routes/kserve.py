"""The Open Inference Protocol (KServe v2) over REST, the subset that Triton's clients use, with Triton's model
configuration and statistics extensions (the protocol itself, apart from its transport, is open_inference.py;
gRPC is protocol/grpc_server.py; the system shared-memory extension, routes/shared_memory.py).

Tensors travel as JSON `data` lists or, with the binary tensor extension (tritonclient's default), as raw
little-endian bytes after the JSON header, whose length is in the Inference-Header-Content-Length header.
Outputs (logits and attention outputs) come back as JSON, or as binary where the request asks for it
(`binary_data` per output, or `binary_data_output` for all): then no float is formatted as text.
Every answer is strict JSON: FP32 input that is not finite (NaN, infinity, or past FP32's range, as 1e39) is a
400, and an output value that is not finite (a model can overflow on huge finite input) is written as null.
"""
import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from typing import Any

import numpy as np
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field, ValidationError

from service.core.errors import BadInput, TooLarge
from service.core.thread_names import name_pool_thread
from service.core.urgency import PRIORITY, TIMEOUT_US_MAX, from_parameters
from service.engine.shared_memory import Slice
from service.pipeline.pipeline import Pipeline
from service.pipeline.served import Pipelines
from service.protocol.open_inference import (Inputs, Side, bytes_elements, check_shared_tensors, extensions,
                                             find_model, model_config, model_inputs, model_outputs, served_metadata,
                                             shared_outputs, text_inputs, text_io)
from service.protocol.statistics import current_statistics

from .shared_memory import client_host

router = APIRouter(prefix="/v2", tags=["kserve-v2"])
HEADER_LENGTH = "Inference-Header-Content-Length"


def _pipelines(request: Request) -> Pipelines:
    return request.app.state.pipelines


def _model(request: Request, name: str, version_: str | None) -> Pipeline:
    return find_model(_pipelines(request), name, version_)


class SharedMemoryParameters(BaseModel):
    """Triton's: the tensor lies in a registered shared-memory region (routes/shared_memory.py), not the body."""
    shared_memory_region: str | None = None
    shared_memory_byte_size: int | None = Field(None, ge=0)
    shared_memory_offset: int = Field(0, ge=0)

    def place(self, what: str) -> Slice | None:
        """Where in shared memory the tensor lies, if it does (the fields are checked already: whole, at least 0)."""
        if self.shared_memory_region is None:
            return None
        if self.shared_memory_byte_size is None:
            raise BadInput(f"{what}: shared_memory_region needs a shared_memory_byte_size")
        return Slice(self.shared_memory_region, self.shared_memory_offset, self.shared_memory_byte_size)


class InputParameters(SharedMemoryParameters):
    binary_data_size: int | None = Field(None, ge=0)


class RequestInput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: Any = None  # JSON numbers, flat or nested; absent when the tensor travels as binary
    parameters: InputParameters = InputParameters()


class OutputParameters(SharedMemoryParameters):
    binary_data: bool | None = None


class RequestOutput(BaseModel):
    name: str
    parameters: OutputParameters = OutputParameters()


class RequestParameters(BaseModel):
    binary_data_output: bool = False
    # whole numbers as JSON writes them (strict: no true, "12" or 1.0, which Triton refuses too)
    timeout: int | None = Field(None, ge=1, le=TIMEOUT_US_MAX, strict=True,
                                description="the client's deadline in µs, as Triton reads it: a request still "
                                            "unanswered then is dropped before its batch and answered 504")
    priority: int | None = Field(None, ge=0, le=100, strict=True, description=PRIORITY)


class InferenceRequest(BaseModel):
    """The request's JSON (the binary tensors that may follow it are not part of it)."""
    id: str | None = None
    inputs: list[RequestInput] = Field(min_length=1)
    outputs: list[RequestOutput] | None = None
    parameters: RequestParameters = RequestParameters()


async def read_body(request: Request, json_limit: int) -> bytes | bytearray:
    """The request's body, refused (413) as soon as its JSON is known to be over `json_limit`: before a byte is
    read where Content-Length (JSON alone) or Inference-Header-Content-Length says so, else as it streams in."""
    header_length = request.headers.get(HEADER_LENGTH)
    declared = header_length if header_length is not None else request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > json_limit:
        raise _json_too_large(json_limit)
    if header_length is not None:  # the JSON's length is given, and checked by parse_request
        return await request.body()
    body = bytearray()  # grown in place: no second copy of a large body, as joining its chunks would make
    async for chunk in request.stream():
        body += chunk
        if len(body) > json_limit:
            raise _json_too_large(json_limit)
    return body


def _json_too_large(limit: int) -> TooLarge:
    return TooLarge(f"the request's JSON is over the {limit}-byte limit for JSON (VITSERVE_MAX_JSON_BYTES): send "
                    "large tensors in binary, after the JSON (the binary tensor extension; tritonclient's "
                    "binary_data=True, its default)", "json_too_large")


def _json_end(body: bytes | bytearray, header_length: str | None) -> int:
    if header_length is None:
        return len(body)
    if not (header_length.isascii() and header_length.isdigit()) or int(header_length) > len(body):
        raise BadInput(f"{HEADER_LENGTH} {header_length!r} is not the length of the JSON that starts the body "
                       f"({len(body)} bytes)")
    return int(header_length)


def parse_request(body: bytes | bytearray, header_length: str | None, pipeline: Pipeline
                  ) -> tuple[InferenceRequest, Inputs]:
    """The request's JSON header and its inputs as the graph's two batches (images, pixel_values) and a relevance
    request's target (else None), or a text request's texts, checked against the model's inputs. Binary tensors
    follow the JSON in the order of the inputs. Pydantic's JSON parser bounds the nesting (a body nested 5,000 deep
    is a 400, not a RecursionError)."""
    json_end = _json_end(body, header_length)
    try:
        header = InferenceRequest.model_validate_json(body if json_end == len(body) else body[:json_end])
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadInput("expected a JSON body with one input tensor {name, shape, datatype, data} or more: "
                       + f"{where}: {first['msg']}".strip(": ")) from None
    starts = np.cumsum([json_end] + [t.parameters.binary_data_size or 0 for t in header.inputs]).tolist()

    def values(i: int, dtype: np.dtype) -> np.ndarray | Slice:
        tensor = header.inputs[i]
        if (place := tensor.parameters.place(f"input {tensor.name!r}")) is not None:
            return place
        try:
            if tensor.parameters.binary_data_size is not None:
                return np.frombuffer(memoryview(body)[starts[i]:starts[i + 1]], dtype=dtype)
            with np.errstate(over="ignore"):  # past FP32's range becomes inf, refused as not finite
                return np.asarray(tensor.data, dtype=dtype).ravel()
        except (ValueError, TypeError, OverflowError):
            raise BadInput(f"input {tensor.name!r}: data is missing or not numbers") from None

    def elements(i: int) -> list[bytes] | Slice:  # a BYTES input's
        tensor = header.inputs[i]
        if (place := tensor.parameters.place(f"input {tensor.name!r}")) is not None:
            return place
        if tensor.parameters.binary_data_size is not None:
            return bytes_elements(memoryview(body)[starts[i]:starts[i + 1]], tensor.name)
        return json_strings(tensor)

    tensors = [(t.name, t.datatype, t.shape) for t in header.inputs]
    texts = text_inputs(pipeline, tensors, elements)
    return header, texts if texts is not None else model_inputs(pipeline, tensors, values)


def json_strings(tensor: RequestInput) -> list[bytes]:
    """A BYTES input's JSON data, flat or one level nested ([B, 1]), as each string's UTF-8 (a lone surrogate
    kept, for text_inputs to refuse)."""
    data = tensor.data if isinstance(tensor.data, list) else None
    if data is not None and all(isinstance(row, list) and len(row) == 1 for row in data):
        data = [row[0] for row in data]
    if data is None or not all(isinstance(value, str) for value in data):
        raise BadInput(f"input {tensor.name!r}: data is missing or not a list of strings")
    return [value.encode("utf-8", "surrogatepass") for value in data]


def json_numbers(value: np.ndarray) -> list:
    """A flat list for JSON, non-finite values as null (as JavaScript's JSON.stringify does): JSON has no NaN,
    and a model can overflow on finite input."""
    flat = value.ravel()
    if np.isfinite(flat).all():
        return flat.tolist()
    return np.where(np.isfinite(flat), flat, None).tolist()


def requested_shared(pipeline: Pipeline, header: InferenceRequest, side: Side) -> dict[str, Slice]:
    """The outputs the request asks for in shared memory, by name."""
    return shared_outputs(pipeline, {out.name: out.parameters.place(f"output {out.name!r}")
                                     for out in header.outputs or []}, side)


def build_response(pipeline: Pipeline, header: InferenceRequest, fields: dict[str, np.ndarray],
                   shared: dict[str, Slice], side: Side = None) -> Response:
    """JSON, or JSON header + raw bytes for the outputs asked for in binary. Those in shared memory (`shared`,
    written there already) are listed as Triton lists them, without data or parameters (its clients take any
    parameters of an output for binary data that follows)."""
    asked = header.outputs or []
    outputs = model_outputs(pipeline, fields, [out.name for out in asked], side)
    binary = {out.name: out.parameters.binary_data for out in asked}
    tensors, blobs = [], []
    for name, value in outputs.items():
        tensor = {"name": name, "datatype": "FP32", "shape": list(value.shape)}
        tensors.append(tensor)
        if name in shared:
            continue
        if header.parameters.binary_data_output if binary.get(name) is None else binary[name]:
            blobs.append(value.tobytes())
            tensor["parameters"] = {"binary_data_size": len(blobs[-1])}
        else:
            tensor["data"] = json_numbers(value)
    body = {"model_name": pipeline.name, "model_version": str(pipeline.entry.version),
            "parameters": {"plan": pipeline.plan}, "outputs": tensors}
    if header.id is not None:
        body["id"] = header.id
    encoded = json.dumps(body).encode()
    if not blobs:
        return Response(encoded, media_type="application/json")
    return Response(encoded + b"".join(blobs), media_type="application/octet-stream",
                    headers={HEADER_LENGTH: str(len(encoded))})


# A JSON header past this is parsed (and its numbers made an array) in a thread, one body at a time: 4 MiB of
# JSON (VITSERVE_MAX_JSON_BYTES' default) takes 10-30 ms on a 2-core host, which on the event loop every other
# client of the process would wait out; in the thread it holds the GIL in slices of a few ms, and one large parse
# at a time bounds the Python objects it makes (bench/abuse_json.py). Smaller ones are not worth the hop.
INLINE_JSON_BYTES = 256 * 1024
_json_thread = ThreadPoolExecutor(1, thread_name_prefix="v2-json", initializer=name_pool_thread)

INFER = {"summary": "Run the model on its inputs: images, pixel values, or both",
         "description": "JSON `{\"inputs\": [{\"name\", \"shape\", \"datatype\", \"data\"}], \"outputs\": [...]}`, or "
                        "the binary tensor extension (raw bytes after the JSON, its length in the "
                        "Inference-Header-Content-Length header). Inputs, as the model metadata lists them, "
                        "each at most once: `images` UINT8 [B1, H, W, 3] (the graph normalises) and "
                        "`pixel_values` FP32 [B2, 3, H, W], normalised as `parameters.preprocessing` of the "
                        "model metadata says; either may be left out or empty, not both. Outputs: logits and "
                        "the attention outputs, B1 + B2 rows, the images' first. `tritonclient.http` works as "
                        "is.",
         "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": {
             "type": "object", "required": ["inputs"], "properties": {
                 "inputs": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
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
    start = time.perf_counter()
    pipelines, length = _pipelines(request), request.headers.get(HEADER_LENGTH)

    async def read(first: Pipeline) -> tuple[Pipeline, bytes | bytearray, tuple | None]:
        """The body, and where its JSON is large, the request parsed for `first` (in a thread of its own)."""
        body, parsed = await read_body(request, pipelines.settings.max_json_bytes), None
        if _json_end(body, length) > INLINE_JSON_BYTES:
            parsed = await asyncio.get_running_loop().run_in_executor(_json_thread, parse_request, body, length,
                                                                      first)
        return first, body, parsed

    pipeline, (first, body, parsed) = await pipelines.routed(read, name, version=version_)
    if parsed is None or pipeline is not first:  # (reloaded while it was parsed: rare, checked again here)
        parsed = parse_request(body, length, pipeline)
    header, inputs = parsed
    given = header.parameters
    from_parameters(start, {"timeout": given.timeout, "priority": given.priority}, pipeline.settings.priority_levels)
    if isinstance(inputs, list):  # a whole CLIP's texts (open_inference.text_inputs)
        requested_shared(pipeline, header, "text")
        vectors, _ = await pipeline.text_tower().embed(inputs)
        return build_response(pipeline, header, {text_io(pipeline)["outputs"][0]["name"]: vectors}, {}, "text")
    images, pixels, target = inputs
    shared = requested_shared(pipeline, header, "relevance" if target is not None else None)
    check_shared_tensors(_pipelines(request), client_host(request), (images, pixels), shared)
    if target is not None:  # the class-specific maps of the images (open_inference.py)
        return build_response(pipeline, header, (await pipeline.relevance(images, target)).fields, {}, "relevance")
    out = await pipeline.tensors(images, pixels, shared)
    return build_response(pipeline, header, out.fields, shared)


@router.get("", summary="Server metadata")
@router.get("/", include_in_schema=False)  # the same answer, not a 307 to /v2: clients join paths with a slash
async def server_metadata(request: Request) -> dict:
    return {"name": "vitserve", "version": version("vitserve"),
            "extensions": extensions(_pipelines(request).settings, client_host(request))}


@router.get("/health/live", summary="200 while the server runs")
async def live() -> dict:
    return {"live": True}


@router.get("/health/ready", summary="200 once every model of the repository serves (with "
                                     "VITSERVE_STRICT_READINESS=false, once one does and none is loading), 400 else")
async def ready(request: Request) -> dict:
    pipelines = _pipelines(request)
    if (problem := pipelines.backend.problem()) is not None:
        raise BadInput(problem.message, "not_ready")  # v2: 4xx means false
    if (why := pipelines.unready()) is not None:
        raise BadInput(why[1], "not_ready")
    return {"ready": True}


METADATA = {"summary": "Model metadata: inputs, outputs and preprocessing"}
READY = {"summary": "200 once this model serves, 400 before or after it failed"}
CONFIG = {"summary": "Triton's model configuration of what serves the model (the model configuration extension)"}
STATS = {"summary": "Triton's statistics of the model's versions: requests, queue and compute times, batches (the "
                    "statistics extension)"}


# before the metadata routes: /v2/models/stats is not a model named "stats"
@router.get("/models/stats", summary="Triton's statistics of every model version served")
async def every_statistics(request: Request) -> dict:
    return await statistics_version(request, "", None)


@router.get("/models/{name}/stats", **STATS)
async def statistics(request: Request, name: str) -> dict:
    return await statistics_version(request, name, None)


@router.get("/models/{name}/versions/{version_}/stats", **STATS)
async def statistics_version(request: Request, name: str, version_: str | None) -> dict:
    return {"model_stats": current_statistics(request.app.state.metrics, _pipelines(request), name, version_)}


@router.get("/models/{name}/config", **CONFIG)
async def config(request: Request, name: str) -> dict:
    return await config_version(request, name, None)


@router.get("/models/{name}/versions/{version_}/config", **CONFIG)
async def config_version(request: Request, name: str, version_: str | None) -> dict:
    return model_config(_pipelines(request), name, version_)


# each route once with and once without its version, so that neither lists a parameter it does not have
@router.get("/models/{name}", **METADATA)
async def metadata(request: Request, name: str) -> dict:
    return await metadata_version(request, name, None)


@router.get("/models/{name}/versions/{version_}", **METADATA)
async def metadata_version(request: Request, name: str, version_: str | None) -> dict:
    return served_metadata(_pipelines(request), name, version_)


@router.get("/models/{name}/ready", **READY)
async def model_ready(request: Request, name: str) -> dict:
    return await model_ready_version(request, name, None)


@router.get("/models/{name}/versions/{version_}/ready", **READY)
async def model_ready_version(request: Request, name: str, version_: str | None) -> dict:
    status = _pipelines(request).backend.status()[_model(request, name, version_).key]
    if not status.ready:
        raise BadInput(f"{name} is not ready" + (f": {status.error}" if status.error else ""), "not_ready")
    return {"name": name, "ready": True}
