"""The Open Inference Protocol (KServe v2) apart from its transport: which model a request names, the model's
metadata and Triton's model configuration of it, a request's inputs checked against it, and the model repository
extension. The REST routes (routes/kserve.py, routes/repository.py) and the gRPC service (grpc_server.py) speak
it over the same pipelines.

A request may send the graph's two inputs, each at most once:
  images        UINT8 [B1, H, W, 3], pixels at the input size: a quarter of the bytes, normalised in the graph;
  pixel_values  FP32 [B2, 3, H, W], already normalised, (x / 255 - mean) / std.
Either may be left out or sent empty (batch 0), not both; a client that sends both gets what the graph computes for
them: B1 + B2 rows of every output, the images' first. The model metadata (and Triton's model configuration) lists
`images` as the model's input and `pixel_values` in its parameters (`other_inputs`), with the preprocessing that
makes them: Triton's tools send every input listed, in one batch whose outputs they expect to have as many rows
(perf_analyzer's shared-memory mode takes no optional input), so they see a model of one input, as Triton would
serve it. FP32 input must be finite: NaN, infinity or a value past FP32's range (1e39) is a BadInput.

Two other requests take other inputs and give other outputs, each listed in the metadata's parameters: a
relevance request (`target` beside `images`: relevance_io) and, for a whole CLIP, a text request (`text` BYTES [B],
Triton's string tensor, alone: text_io), whose output is the texts' embeddings.
"""
from collections.abc import Callable
from functools import cache
from pathlib import Path

import numpy as np

from repository import version_policy
from service.core.errors import BadInput, Forbidden, NotFound
from service.core.settings import Settings
from service.engine.records import output_names
from service.engine.runtime import CUDA, batches_in_flight
from service.engine.shared_memory import SharedTensor, Slice, local_client
from service.pipeline.pipeline import Pipeline
from service.pipeline.served import Pipelines

DATATYPES = {"FP32": np.dtype("<f4"), "UINT8": np.dtype("u1")}
TEXT_INPUT = "text"  # a whole CLIP's texts over /v2 (text_io)
Side = str | None  # which graph a request runs: None (the model's), "relevance" or "text"


def extensions(settings: Settings, host: str | None) -> list[str]:
    """The extensions of the protocol this server speaks to a client (its address; None: a Unix-socket peer), by
    Triton's names (server metadata, REST and gRPC): system shared memory where that client may use it."""
    return ["binary_tensor_data", "model_repository", "model_configuration", "statistics",
            *(["system_shared_memory"] if shared_memory_refusal(settings.shared_memory, host) is None else [])]


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


@cache  # read on every request; the same for the pipeline's lifetime
def accepted_inputs(pipeline: Pipeline) -> list[dict]:
    """The inputs a request may send (either or both): `images`, then `pixel_values`."""
    m = pipeline.entry.manifest
    h, w = m["input"]["size"]
    return [{"name": m["input"]["name"], "datatype": "UINT8", "shape": [-1, h, w, 3]},
            {"name": m["tensor_input"]["name"], "datatype": "FP32", "shape": [-1, 3, h, w]}]


@cache
def relevance_io(pipeline: Pipeline) -> dict | None:
    """The relevance request's input and outputs (the metadata's parameters.relevance), None without the graph."""
    section = pipeline.entry.manifest.get("relevance")
    if section is None:
        return None
    classes, cells = len(pipeline.entry.labels), section["grid"][0] * section["grid"][1]
    return {"rule": section["rule"], "grid": section["grid"], "rows": section["rows"],
            "input": {"name": section["input"], "datatype": "FP32", "shape": [-1, classes]},
            "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, classes]},
                        {"name": section["output"], "datatype": "FP32", "shape": [-1, len(section["rows"]), cells]}]}


@cache
def text_io(pipeline: Pipeline) -> dict | None:
    """A text request's input and output (the metadata's parameters.text), None for a model without a text tower."""
    text = pipeline.entry.manifest.get("text")
    if text is None:
        return None
    return {"input": {"name": TEXT_INPUT, "datatype": "BYTES", "shape": [-1]},
            "outputs": [{"name": text["output"], "datatype": "FP32", "shape": [-1, text["size"]]}],
            "context_length": text["context_length"]}


@cache
def model_metadata(pipeline: Pipeline) -> dict:
    """The model's input (`images`) and outputs; `pixel_values` and how to make them in its parameters."""
    m, (images, *others) = pipeline.entry.manifest, accepted_inputs(pipeline)
    return {
        "name": pipeline.name, "versions": [str(pipeline.entry.version)], "platform": "onnxruntime_onnx",
        # attention_outputs: the outputs attention maps are drawn from, none for a CNN
        "parameters": {"preprocessing": pipeline.entry.preprocessing, "other_inputs": others,
                       "attention_outputs": pipeline.attention_outputs, "relevance": relevance_io(pipeline),
                       "text": text_io(pipeline)},
        "inputs": [images],
        "outputs": [{"name": o["name"], "datatype": "FP32", "shape": [-1 if d == "batch" else d for d in o["shape"]]}
                    for o in m["outputs"]],
    }


def model_config(pipelines: Pipelines, name: str, version: str | None) -> dict:
    """Triton's model configuration of what serves the model now (its JSON form, as Triton's REST route gives it):
    inputs and outputs from the metadata without the batch dimension, the batcher's settings, and the instances as
    they run (batches in flight on the provider that runs the graph)."""
    pipeline = find_model(pipelines, name, version)
    status, settings = pipelines.backend.status()[pipeline.key], pipelines.settings
    metadata, entry, batching = model_metadata(pipeline), pipeline.entry, pipeline.batching
    formats = {"UINT8": "FORMAT_NHWC", "FP32": "FORMAT_NCHW"}  # of the inputs the metadata lists
    gpu = status.provider == CUDA
    instances = {"name": pipeline.name, "kind": "KIND_GPU" if gpu else "KIND_CPU",
                 "count": batches_in_flight(status.provider), **({"gpus": [0]} if gpu else {})}
    parameters = {"architecture": entry.manifest["architecture"], "task": entry.task,
                  "precision": status.precision or entry.precision, "provider": status.provider or "",
                  "graph": status.graph or pipeline.key, **({"plan": status.plan} if status.plan else {})}
    return {
        "name": pipeline.name, "platform": "onnxruntime_onnx", "backend": "onnxruntime",
        "version_policy": _version_policy(entry.folder),
        "max_batch_size": batching.max_batch_size,
        "input": [{"name": i["name"], "data_type": f"TYPE_{i['datatype']}", "format": formats[i["datatype"]],
                   "dims": i["shape"][1:]} for i in metadata["inputs"]],
        "output": [{"name": o["name"], "data_type": f"TYPE_{o['datatype']}", "dims": o["shape"][1:]}
                   for o in metadata["outputs"]],
        "dynamic_batching": {"max_queue_delay_microseconds": round(batching.max_queue_delay_s * 1e6),
                             "priority_levels": settings.priority_levels,
                             "default_priority_level": settings.priority_levels},
        "instance_group": [instances],
        "default_model_filename": Path(entry.manifest["files"]["model"]["path"]).name,
        "parameters": {key: {"string_value": value} for key, value in parameters.items()},
    }


def _version_policy(folder: Path) -> dict:
    """The model folder's policy.json in Triton's terms (a flat folder serves its one version: latest 1)."""
    policy = version_policy(folder.parent) if folder.name.isdigit() else {"latest": 1}
    if "latest" in policy:
        return {"latest": {"num_versions": policy["latest"]}}
    return {"all": {}} if "all" in policy else {"specific": {"versions": policy["specific"]}}


def input_dtype(pipeline: Pipeline, name: str, datatype: str, shape: list[int]) -> np.dtype:
    """The dtype of a request's input, once its name, datatype and shape are checked against the model's."""
    inputs = accepted_inputs(pipeline)
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


Batch = np.ndarray | SharedTensor  # an input sent in the request, or kept in shared memory
Inputs = tuple[Batch, Batch, np.ndarray | None] | list[str]  # model_inputs' (images, pixels, target), or texts


def model_inputs(pipeline: Pipeline, tensors: list[Tensor], values: Callable[[int, np.dtype], np.ndarray | Slice]
                 ) -> tuple[Batch, Batch, np.ndarray | None]:
    """A request's inputs as the graph's two batches (uint8 images, float pixel_values), an input not sent as an
    empty batch, and the relevance target where it was sent (relevance_target). `values(i, dtype)`: input i's flat
    values, as its transport carries them, or where in shared memory they are, read once its name, datatype and
    shape are checked."""
    if not tensors:
        raise BadInput("no input tensors; send `images` UINT8, `pixel_values` FP32, or both")
    names = [name for name, _, _ in tensors]
    if twice := next((name for name in names if names.count(name) > 1), None):
        raise BadInput(f"input {twice!r} sent twice; send each input at most once")
    io = relevance_io(pipeline)
    if io is not None and io["input"]["name"] in names:
        i = names.index(io["input"]["name"])
        target = relevance_target(io, tensors[i], values(i, DATATYPES["FP32"]) if tensors[i][1] == "FP32" else None)
        images, pixels, _ = model_inputs(pipeline, tensors[:i] + tensors[i + 1:],
                                         lambda j, dtype: values(j + (j >= i), dtype))
        if len(pixels) or not isinstance(images, np.ndarray) or len(images) != len(target):
            raise BadInput(f"a relevance request (input {io['input']['name']!r}) takes `images` UINT8 in the request "
                           f"(not in shared memory), a row of {io['input']['name']!r} each, and no `pixel_values`")
        return images, pixels, target

    def batch(i: int, name: str, datatype: str, shape: list[int]) -> Batch:
        dtype = input_dtype(pipeline, name, datatype, shape)
        got = values(i, dtype)
        if not isinstance(got, Slice):
            return input_batch(got, shape)
        if got.byte_size != (want := int(np.prod(shape)) * dtype.itemsize):
            raise BadInput(f"input {name!r} in shared memory of {got.byte_size} bytes; shape {shape} takes {want}")
        return SharedTensor(got, tuple(shape))

    batches = {name: batch(i, name, datatype, shape) for i, (name, datatype, shape) in enumerate(tensors)}
    m = pipeline.entry.manifest
    h, w = m["input"]["size"]
    return (batches.get(m["input"]["name"], np.zeros((0, h, w, 3), np.uint8)),
            batches.get(m["tensor_input"]["name"], np.zeros((0, 3, h, w), np.float32)), None)


def text_inputs(pipeline: Pipeline, tensors: list[Tensor], values: Callable[[int], list[bytes] | Slice]
                ) -> list[str] | None:
    """A text request's texts (text_io), None where the request sends no `text` input: its only input, BYTES of
    shape [B] or [B, 1], each element UTF-8. `values(i)`: input i's elements, as its transport carries them."""
    io = text_io(pipeline)
    names = [name for name, _, _ in tensors]
    if io is None or TEXT_INPUT not in names:
        return None
    if len(tensors) > 1:
        raise BadInput(f"a text request (input {TEXT_INPUT!r}) takes no other input; send images apart")
    name, datatype, shape = tensors[0]
    if datatype != "BYTES" or len(shape) not in (1, 2) or shape[1:] not in ([], [1]) or shape[0] < 1:
        raise BadInput(f"input {name!r} {datatype} {shape}; this model takes {name!r} BYTES [-1] (or [-1, 1]): "
                       "one string a text")
    elements = values(0)
    if isinstance(elements, Slice):
        raise BadInput(f"input {name!r} in shared memory: send the texts in the request")
    if len(elements) != shape[0]:
        raise BadInput(f"input {name!r} has {len(elements)} elements for shape {shape}")
    texts = []
    for i, element in enumerate(elements):
        try:
            texts.append(element.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise BadInput(f"input {name!r} element {i} is not UTF-8: {e.reason}", "not_utf8") from None
    return texts


def bytes_elements(raw: bytes | memoryview, name: str) -> list[bytes]:
    """A BYTES tensor's elements from Triton's binary form: each a 4-byte little-endian length, then its bytes."""
    raw, elements, at = memoryview(raw), [], 0
    while at < len(raw):
        if at + 4 > len(raw):
            raise BadInput(f"input {name!r}: {len(raw) - at} bytes after element {len(elements)} are no 4-byte "
                           "length")
        size = int.from_bytes(raw[at:at + 4], "little")
        if at + 4 + size > len(raw):
            raise BadInput(f"input {name!r}: element {len(elements)} says {size} bytes; {len(raw) - at - 4} follow")
        elements.append(bytes(raw[at + 4:at + 4 + size]))
        at += 4 + size
    return elements


def relevance_target(io: dict, tensor: Tensor, data: np.ndarray | Slice | None) -> np.ndarray:
    """The `target` input (relevance_io) as float32 [B, classes], once its datatype, shape and values are checked."""
    name, datatype, shape = tensor
    want = io["input"]
    if datatype != "FP32" or len(shape) != 2 or shape[1] != want["shape"][1] or shape[0] < 1:
        raise BadInput(f"input {name!r} {datatype} {shape}; this model takes {name!r} FP32 {want['shape']}: a weight "
                       "vector over its classes per image")
    if isinstance(data, Slice):
        raise BadInput(f"input {name!r} in shared memory: send the relevance target in the request")
    return input_batch(data, shape)


def outputs_of(pipeline: Pipeline, side: Side) -> list[str]:
    """The outputs a request gets: the main graph's, a relevance request's (relevance_io) or a text request's."""
    if side is None:
        return output_names(pipeline.entry)
    return [o["name"] for o in (relevance_io if side == "relevance" else text_io)(pipeline)["outputs"]]


def check_outputs(pipeline: Pipeline, asked: list[str], side: Side = None) -> None:
    names = outputs_of(pipeline, side)
    unknown = [name for name in asked if name not in names]
    if unknown:
        none = "" if pipeline.entry.attention else f" ({pipeline.name} has no attention outputs)"
        also = "".join(f"; send the input {io['input']['name']!r} for the {what} outputs"
                       for what, io in (("relevance", relevance_io(pipeline)), ("text", text_io(pipeline)))
                       if io is not None and side != what)
        raise BadInput(f"no output {unknown[0]!r}; outputs: {', '.join(names)}{none}{also}")


def model_outputs(pipeline: Pipeline, fields: dict[str, np.ndarray], asked: list[str], side: Side = None
                  ) -> dict[str, np.ndarray]:
    """The outputs asked for (all where none are), by name, as little-endian FP32; a relevance or text request's
    where `side` says."""
    check_outputs(pipeline, asked, side)
    return {name: np.ascontiguousarray(fields[name], dtype="<f4") for name in asked or outputs_of(pipeline, side)}


def shared_outputs(pipeline: Pipeline, asked: dict[str, Slice | None], side: Side = None) -> dict[str, Slice]:
    """The outputs asked for in shared memory (by name: where), their names checked before anything runs (a
    relevance or text request's outputs are answered in the response alone)."""
    check_outputs(pipeline, list(asked), side)
    shared = {name: place for name, place in asked.items() if place is not None}
    if side and shared:
        raise BadInput(f"a {side} request's outputs come back in the response: ask for them without "
                       "shared_memory_region")
    return shared



async def repository_index(pipelines: Pipelines, ready_only: bool) -> list[dict]:
    """The repository extension's index: a row per model version, {name, version, state, reason}."""
    rows = await pipelines.backend.models.index()
    return [row for row in rows if row["state"] == "READY" or not ready_only]


def shared_memory_refusal(mode: str, host: str | None) -> Forbidden | None:
    """Why a client (its address; None: a Unix-socket peer) may not use system shared memory under
    VITSERVE_SHARED_MEMORY=`mode`, or None where it may. A region is a file of this host that the server reads and
    writes for the client, so by default only a client on this host may name one."""
    if mode == "false":
        return Forbidden("the system shared-memory extension is off on this server (VITSERVE_SHARED_MEMORY=false)",
                         "shared_memory_off")
    if mode == "local" and not local_client(host):
        return Forbidden(f"system shared memory is only for clients on this server's host (loopback or a Unix "
                         f"socket), not {host} (VITSERVE_SHARED_MEMORY=local; =any lets every client use it)",
                         "shared_memory_not_local")
    return None


def regions_backend(pipelines: Pipelines, host: str | None):
    """The backend, which keeps the shared-memory regions, for a client that may use them (Forbidden else)."""
    if (refusal := shared_memory_refusal(pipelines.settings.shared_memory, host)) is not None:
        raise refusal
    return pipelines.backend


def check_shared_tensors(pipelines: Pipelines, host: str | None, inputs: tuple[Batch, Batch],
                         outputs: dict[str, Slice]) -> None:
    """A request whose tensors name a region is the regions' routes' to refuse (Forbidden): else a client refused
    them could have the server read or write a region that a client on this host registered."""
    if outputs or any(isinstance(x, SharedTensor) for x in inputs):
        regions_backend(pipelines, host)


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
