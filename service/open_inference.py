"""The Open Inference Protocol (KServe v2) apart from its transport: which model a request names, the model's
metadata, a request's inputs checked against it, and the model repository extension. The REST routes
(routers/kserve.py, routers/repository.py) and the gRPC service (grpc_server.py) speak it over the same
pipelines.

What model metadata lists is what a request may send: the graph's two inputs, each at most once,
  images        UINT8 [B1, H, W, 3], pixels at the input size: a quarter of the bytes, normalised in the graph;
  pixel_values  FP32 [B2, 3, H, W], already normalised, (x / 255 - mean) / std.
Either may be left out or sent empty (batch 0), not both; a client that sends every listed input gets what the
graph computes for them: B1 + B2 rows of every output, the images' first. FP32 input must be finite: NaN,
infinity or a value past FP32's range (1e39) is a BadInput.
"""
from collections.abc import Callable
from functools import cache

import numpy as np

from .errors import BadInput, Forbidden, NotFound
from .pipeline import Pipeline, Pipelines
from .records import output_names

DATATYPES = {"FP32": np.dtype("<f4"), "UINT8": np.dtype("u1")}


def find_model(pipelines: Pipelines, name: str, version: str | None) -> Pipeline:
    """The named model, ready or not: the version asked for, else the one its name reaches; NotFound else."""
    pipeline = pipelines.find(name, version)
    if pipeline is None:
        raise NotFound(f"no model {name!r}" + (f" version {version}" if version else ""), "model_not_found")
    return pipeline


def served_metadata(pipelines: Pipelines, name: str, version: str | None) -> dict:
    """The metadata route's answer: the model's (the version asked for, else the one its name reaches), with every
    version of it that serves."""
    pipeline = find_model(pipelines, name, version)
    return {**model_metadata(pipeline), "versions": pipelines.versions(pipeline.name)}


@cache  # read on every infer request; the same for the pipeline's lifetime
def model_metadata(pipeline: Pipeline) -> dict:
    """The model's inputs (a request sends either or both) and outputs."""
    m = pipeline.entry.manifest
    h, w = m["input"]["size"]
    return {
        "name": pipeline.name, "versions": [str(pipeline.entry.version)], "platform": "onnxruntime_onnx",
        "parameters": {"preprocessing": pipeline.entry.preprocessing},  # how to make `pixel_values` from a photo
        "inputs": [{"name": m["tensor_input"]["name"], "datatype": "FP32", "shape": [-1, 3, h, w]},
                   {"name": m["input"]["name"], "datatype": "UINT8", "shape": [-1, h, w, 3]}],
        "outputs": [{"name": o["name"], "datatype": "FP32", "shape": [-1 if d == "batch" else d for d in o["shape"]]}
                    for o in m["outputs"]],
    }


def input_dtype(pipeline: Pipeline, name: str, datatype: str, shape: list[int]) -> np.dtype:
    """The dtype of a request's input, once its name, datatype and shape are checked against the model's."""
    inputs = model_metadata(pipeline)["inputs"]
    wanted = next((i for i in inputs if i["name"] == name), None)
    if wanted is None or wanted["datatype"] != datatype:
        raise BadInput(f"input {name!r} {datatype}; this model takes "
                       + " or ".join(f"{i['name']!r} {i['datatype']} {i['shape']}" for i in inputs))
    if len(shape) != 4 or shape[1:] != wanted["shape"][1:] or shape[0] < 0:
        raise BadInput(f"input shape {shape}; this model takes {wanted['shape']} for {datatype}")
    return DATATYPES[datatype]


def input_batch(data: np.ndarray, shape: list[int]) -> np.ndarray:
    """A request's flat input values as its batch, once there are as many as its shape holds, all finite."""
    count = int(np.prod(shape))
    if data.size != count:
        raise BadInput(f"input has {data.size} values for shape {shape} ({count})")
    if data.dtype.kind == "f" and not np.isfinite(data).all():
        raise BadInput("input has values that are not finite (NaN, infinity, or past FP32's range)", "non_finite")
    return data.reshape(shape)


Tensor = tuple[str, str, list[int]]  # a request's input: name, datatype, shape


def model_inputs(pipeline: Pipeline, tensors: list[Tensor], values: Callable[[int, np.dtype], np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray]:
    """A request's inputs as the graph's two batches (uint8 images, float pixel_values), an input not sent as an
    empty batch. `values(i, dtype)`: input i's flat values, as its transport carries them, read once its name,
    datatype and shape are checked."""
    if not tensors:
        raise BadInput("no input tensors; send `images` UINT8, `pixel_values` FP32, or both")
    names = [name for name, _, _ in tensors]
    if twice := next((name for name in names if names.count(name) > 1), None):
        raise BadInput(f"input {twice!r} sent twice; send each input at most once")
    batches = {name: input_batch(values(i, input_dtype(pipeline, name, datatype, shape)), shape)
               for i, (name, datatype, shape) in enumerate(tensors)}
    m = pipeline.entry.manifest
    h, w = m["input"]["size"]
    return (batches.get(m["input"]["name"], np.zeros((0, h, w, 3), np.uint8)),
            batches.get(m["tensor_input"]["name"], np.zeros((0, 3, h, w), np.float32)))


def model_outputs(pipeline: Pipeline, fields: dict[str, np.ndarray], asked: list[str]) -> dict[str, np.ndarray]:
    """The outputs asked for (all where none are), by name, as little-endian FP32."""
    names = output_names(pipeline.entry)
    unknown = [name for name in asked if name not in names]
    if unknown:
        raise BadInput(f"no output {unknown[0]!r}; outputs: {', '.join(names)}")
    return {name: np.ascontiguousarray(fields[name], dtype="<f4") for name in asked or names}


async def repository_index(pipelines: Pipelines, ready_only: bool) -> list[dict]:
    """The repository extension's index: a row per model version, {name, version, state, reason}."""
    rows = await pipelines.backend.index()
    return [row for row in rows if row["state"] == "READY" or not ready_only]


def require_model_control(pipelines: Pipelines) -> None:
    """Load and unload answer only with VITSERVE_MODEL_CONTROL=explicit."""
    if pipelines.settings.model_control != "explicit":
        raise Forbidden(f"models are loaded and unloaded by request only with VITSERVE_MODEL_CONTROL=explicit (this "
                        f"server: {pipelines.settings.model_control})", "model_control_off")


def check_load_parameters(names) -> None:
    """A load request's parameters: a model loads from its folder, not from a config or files sent along."""
    if set(names) - {"unload_dependents"}:
        raise BadInput("a model loads from its repository folder: a config or files in the request are not "
                       "supported (write them with python -m export)", "unsupported_parameters")
