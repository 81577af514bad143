"""The Open Inference Protocol over gRPC: `inference.GRPCInferenceService`, what `tritonclient.grpc`, KServe and
MLServer clients speak, on its own port beside the HTTP server (VITSERVE_GRPC_PORT, 8001 as Triton's; 0: off).

It runs in the HTTP server's event loop over the same pipelines, batchers, limits and metrics as the REST routes,
so one batch can hold images from REST and gRPC clients. Under the process backend every HTTP worker serves it on
the one port (SO_REUSEPORT: the kernel spreads the connections over the workers). Inputs come as
`raw_input_contents` (what tritonclient.grpc sends) or typed `contents`; outputs go back as `raw_output_contents`.
ModelStreamInfer, Triton's bidirectional stream (tritonclient.grpc's start_stream), answers each request of a
stream as ModelInfer would, in the order they finish.
Errors are status codes, as Triton's: INVALID_ARGUMENT for a bad tensor, NOT_FOUND for an unknown model,
UNAVAILABLE (trailing metadata `retry-after`, seconds) when overloaded or loading, RESOURCE_EXHAUSTED for more
images than a queue holds, UNAUTHENTICATED without the API key (metadata `x-api-key`) where one is set,
PERMISSION_DENIED for a load or unload without VITSERVE_MODEL_CONTROL=explicit, and for system shared memory (its
RPCs, or a request that names a region) where the client may not use it (open_inference.shared_memory_refusal).
"""
import asyncio
import functools
import logging
import time
from importlib.metadata import version
from urllib.parse import unquote

import grpc
import numpy as np
from google.protobuf import json_format

from service.core import tracing
from service.core.api_key import check_key
from service.core.errors import (BadInput, DeadlineExceeded, Forbidden, NotFound, ServiceError, TooLarge,
                                 Unauthenticated, Unavailable, UnsupportedMedia)
from service.core.metrics import Metrics, RequestCounter
from service.core.settings import Settings
from service.core.urgency import from_parameters
from service.engine.shared_memory import NO_CUDA_SHARED_MEMORY, no_cuda_region, requested_slice
from service.pipeline.served import Pipelines

from . import open_inference_pb2 as pb
from .open_inference import (bytes_elements, check_load_parameters, check_shared_tensors, extensions, find_model,
                             model_config, model_inputs, model_outputs, regions_backend, repository_index,
                             require_model_control, served_metadata, shared_outputs, text_inputs, text_io)
from .statistics import current_statistics

log = logging.getLogger("vitserve")


STATUS = {BadInput: grpc.StatusCode.INVALID_ARGUMENT, UnsupportedMedia: grpc.StatusCode.INVALID_ARGUMENT,
          NotFound: grpc.StatusCode.NOT_FOUND, TooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
          Unavailable: grpc.StatusCode.UNAVAILABLE, Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
          Forbidden: grpc.StatusCode.PERMISSION_DENIED, DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED}
SERVICE = "inference.GRPCInferenceService"
RPCS = {  # each method's request and response messages
    "ServerLive": (pb.ServerLiveRequest, pb.ServerLiveResponse),
    "ServerReady": (pb.ServerReadyRequest, pb.ServerReadyResponse),
    "ServerMetadata": (pb.ServerMetadataRequest, pb.ServerMetadataResponse),
    "ModelReady": (pb.ModelReadyRequest, pb.ModelReadyResponse),
    "ModelMetadata": (pb.ModelMetadataRequest, pb.ModelMetadataResponse),
    "ModelInfer": (pb.ModelInferRequest, pb.ModelInferResponse),
    "RepositoryIndex": (pb.RepositoryIndexRequest, pb.RepositoryIndexResponse),
    "RepositoryModelLoad": (pb.RepositoryModelLoadRequest, pb.RepositoryModelLoadResponse),
    "RepositoryModelUnload": (pb.RepositoryModelUnloadRequest, pb.RepositoryModelUnloadResponse),
    "ModelConfig": (pb.ModelConfigRequest, pb.ModelConfigResponse),
    "ModelStatistics": (pb.ModelStatisticsRequest, pb.ModelStatisticsResponse),
    "SystemSharedMemoryRegister": (pb.SystemSharedMemoryRegisterRequest, pb.SystemSharedMemoryRegisterResponse),
    "SystemSharedMemoryStatus": (pb.SystemSharedMemoryStatusRequest, pb.SystemSharedMemoryStatusResponse),
    "SystemSharedMemoryUnregister": (pb.SystemSharedMemoryUnregisterRequest,
                                     pb.SystemSharedMemoryUnregisterResponse),
    "CudaSharedMemoryRegister": (pb.CudaSharedMemoryRegisterRequest, pb.CudaSharedMemoryRegisterResponse),
    "CudaSharedMemoryStatus": (pb.CudaSharedMemoryStatusRequest, pb.CudaSharedMemoryStatusResponse),
    "CudaSharedMemoryUnregister": (pb.CudaSharedMemoryUnregisterRequest, pb.CudaSharedMemoryUnregisterResponse),
}
OPEN = {"ServerLive", "ServerReady", "ServerMetadata"}  # as /v2 and the health routes: no key asked


def failure(e: Exception, name: str) -> tuple[grpc.StatusCode, str]:
    """A failed call's status code and message: the service's own errors as Triton's codes, anything else a fault
    of the server's, INTERNAL (as REST's 500) and logged."""
    if isinstance(e, ServiceError):
        return STATUS.get(type(e), grpc.StatusCode.INTERNAL), e.message
    log.exception("gRPC %s failed", name)
    return grpc.StatusCode.INTERNAL, f"the server failed: {type(e).__name__}: {e}"


def rpc(method):
    """An RPC's errors as status codes, its key checked (where one is set), and it counted and timed as the
    HTTP routes are (route: its gRPC method path; method: GRPC; status: the code's name)."""
    name = method.__name__

    @functools.wraps(method)
    async def handle(self: "InferenceService", request, context: grpc.aio.ServicerContext):
        start, code = time.perf_counter(), grpc.StatusCode.OK
        try:
            if name not in OPEN:
                self.authorize(context)
            return await method(self, request, context)
        except Exception as e:  # a cancellation passes by (a BaseException)
            code, message = failure(e, name)
            retry = getattr(e, "retry_after_s", None)
            await context.abort(code, message, trailing_metadata=(("retry-after", str(retry)),) if retry else ())
        finally:
            self.count(name, code, time.perf_counter() - start)

    return handle


class InferenceService:
    def __init__(self, pipelines: Pipelines, settings: Settings, metrics: Metrics):
        self.pipelines, self.metrics = pipelines, metrics
        self.key = settings.api_key.get_secret_value().encode() if settings.api_key is not None else None
        self._counted = RequestCounter(metrics)

    def count(self, name: str, code: grpc.StatusCode, seconds: float) -> None:
        """One call in the request metrics."""
        self._counted(f"/{SERVICE}/{name}", "GRPC", code.name, seconds)

    def authorize(self, context: grpc.aio.ServicerContext) -> None:
        if self.key is not None:
            given = dict(context.invocation_metadata() or ()).get("x-api-key", "")
            check_key(given.encode(), self.key, "the x-api-key metadata")

    @rpc
    async def ServerLive(self, request: pb.ServerLiveRequest, context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    @rpc
    async def ServerReady(self, request: pb.ServerReadyRequest, context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.pipelines.ready)

    @rpc
    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="vitserve", version=version("vitserve"),
                                         extensions=extensions(self.pipelines.settings, peer_host(context.peer())))

    @rpc
    async def ModelReady(self, request: pb.ModelReadyRequest, context) -> pb.ModelReadyResponse:
        pipeline = find_model(self.pipelines, request.name, request.version)
        return pb.ModelReadyResponse(ready=self.pipelines.backend.status()[pipeline.key].ready)

    @rpc
    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context) -> pb.ModelMetadataResponse:
        metadata = served_metadata(self.pipelines, request.name, request.version)
        tensors = {kind: [pb.ModelMetadataResponse.TensorMetadata(**t) for t in metadata[kind]]
                   for kind in ("inputs", "outputs")}
        return pb.ModelMetadataResponse(name=metadata["name"], versions=metadata["versions"],
                                        platform=metadata["platform"], **tensors)

    @rpc
    async def ModelConfig(self, request: pb.ModelConfigRequest, context) -> pb.ModelConfigResponse:
        config = model_config(self.pipelines, request.name, request.version)
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, pb.ModelConfig()))

    @rpc
    async def ModelStatistics(self, request: pb.ModelStatisticsRequest, context) -> pb.ModelStatisticsResponse:
        stats = current_statistics(self.metrics, self.pipelines, request.name, request.version)
        return pb.ModelStatisticsResponse(model_stats=[json_format.ParseDict(s, pb.ModelStatistics()) for s in stats])

    @rpc
    async def SystemSharedMemoryRegister(self, request: pb.SystemSharedMemoryRegisterRequest, context
                                         ) -> pb.SystemSharedMemoryRegisterResponse:
        await regions_backend(self.pipelines, peer_host(context.peer())).register_region(
            request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @rpc
    async def SystemSharedMemoryStatus(self, request: pb.SystemSharedMemoryStatusRequest, context
                                       ) -> pb.SystemSharedMemoryStatusResponse:
        regions = await regions_backend(self.pipelines, peer_host(context.peer())).region_status(request.name)
        return pb.SystemSharedMemoryStatusResponse(
            regions={r["name"]: pb.SystemSharedMemoryStatusResponse.RegionStatus(**r) for r in regions})

    @rpc
    async def SystemSharedMemoryUnregister(self, request: pb.SystemSharedMemoryUnregisterRequest, context
                                           ) -> pb.SystemSharedMemoryUnregisterResponse:
        await regions_backend(self.pipelines, peer_host(context.peer())).unregister_region(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    # CUDA shared memory is not offered: nothing registers, so there is nothing to list or unregister
    @rpc
    async def CudaSharedMemoryRegister(self, request: pb.CudaSharedMemoryRegisterRequest, context
                                       ) -> pb.CudaSharedMemoryRegisterResponse:
        raise BadInput(NO_CUDA_SHARED_MEMORY)

    @rpc
    async def CudaSharedMemoryStatus(self, request: pb.CudaSharedMemoryStatusRequest, context
                                     ) -> pb.CudaSharedMemoryStatusResponse:
        if request.name:
            raise no_cuda_region(request.name)
        return pb.CudaSharedMemoryStatusResponse()

    @rpc
    async def CudaSharedMemoryUnregister(self, request: pb.CudaSharedMemoryUnregisterRequest, context
                                         ) -> pb.CudaSharedMemoryUnregisterResponse:
        return pb.CudaSharedMemoryUnregisterResponse()

    @rpc
    async def ModelInfer(self, request: pb.ModelInferRequest, context) -> pb.ModelInferResponse:
        with tracing.call_span("ModelInfer", context.invocation_metadata() or ()):
            return await self.infer(request, peer_host(context.peer()), context.time_remaining())

    @rpc
    async def RepositoryIndex(self, request: pb.RepositoryIndexRequest, context) -> pb.RepositoryIndexResponse:
        rows = await repository_index(self.pipelines, request.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**row) for row in rows])

    @rpc
    async def RepositoryModelLoad(self, request: pb.RepositoryModelLoadRequest, context
                                  ) -> pb.RepositoryModelLoadResponse:
        require_model_control(self.pipelines)
        check_load_parameters(request.parameters)
        await self.pipelines.backend.models.load(request.model_name)
        return pb.RepositoryModelLoadResponse()

    @rpc
    async def RepositoryModelUnload(self, request: pb.RepositoryModelUnloadRequest, context
                                    ) -> pb.RepositoryModelUnloadResponse:
        require_model_control(self.pipelines)
        await self.pipelines.backend.models.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    async def ModelStreamInfer(self, requests, context: grpc.aio.ServicerContext):
        """Triton's stream: every request answered as ModelInfer answers it, in the order they finish (a response
        carries its request's id), an error as a response's message while the stream goes on. Each request is
        counted in the request metrics; a client that ends the call cancels what it still waits for."""
        try:
            self.authorize(context)
        except Unauthenticated as e:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, e.message)
        answers: asyncio.Queue = asyncio.Queue()
        host = peer_host(context.peer())

        async def answer(request: pb.ModelInferRequest) -> None:
            start, code = time.perf_counter(), grpc.StatusCode.OK
            try:
                await answers.put(pb.ModelStreamInferResponse(infer_response=await self.infer(request, host)))
            except Exception as e:  # the client's mistake or the server's fault: said, and the stream goes on
                code, message = failure(e, "ModelStreamInfer")
                await answers.put(pb.ModelStreamInferResponse(error_message=message,
                                                              infer_response=pb.ModelInferResponse(id=request.id)))
            finally:
                self.count("ModelStreamInfer", code, time.perf_counter() - start)

        async def read() -> None:
            async with asyncio.TaskGroup() as calls:
                async for request in requests:
                    calls.create_task(answer(request))
            await answers.put(None)  # every request read and answered

        reader = asyncio.create_task(read())
        try:
            while (response := await answers.get()) is not None:
                yield response
        finally:
            reader.cancel()

    async def infer(self, request: pb.ModelInferRequest, host: str | None, call_s: float | None = None
                    ) -> pb.ModelInferResponse:
        """ModelInfer's answer to a client (its address, as peer_host gives it), within the call's deadline
        (`call_s` seconds left) and the request's `timeout` parameter (µs, Triton's), the sooner."""
        from_parameters(time.perf_counter(), parameters(request.parameters), self.pipelines.settings.priority_levels,
                        call_s)
        pipeline = self.pipelines.get(request.model_name, version=request.model_version)
        places = [requested_slice(parameters(t.parameters), f"input {t.name!r}") for t in request.inputs]
        sent = [i for i, place in enumerate(places) if place is None]  # the inputs whose values travel here
        raw = dict(zip(sent, request.raw_input_contents))
        if request.raw_input_contents and len(request.raw_input_contents) != len(sent):
            raise BadInput(f"{len(request.raw_input_contents)} raw_input_contents for {len(sent)} inputs not in "
                           "shared memory: send one per input, in the inputs' order, or none (typed contents)")
        tensors = [(t.name, t.datatype, list(t.shape)) for t in request.inputs]
        asked = {o.name: requested_slice(parameters(o.parameters), f"output {o.name!r}") for o in request.outputs}
        texts = text_inputs(pipeline, tensors, lambda i: places[i] or string_values(request.inputs[i], raw.get(i)))
        if texts is not None:  # a whole CLIP's texts (open_inference.text_inputs)
            side, shared = "text", shared_outputs(pipeline, asked, "text")
            fields = {text_io(pipeline)["outputs"][0]["name"]: (await pipeline.text_tower().embed(texts))[0]}
        else:
            images, pixels, target = model_inputs(pipeline, tensors, lambda i, dtype: places[i] or tensor_values(
                request.inputs[i], raw.get(i), dtype))
            side = "relevance" if target is not None else None  # the class-specific maps of the images
            shared = shared_outputs(pipeline, asked, side)
            check_shared_tensors(self.pipelines, host, (images, pixels), shared)
            fields = (await (pipeline.relevance(images, target) if side else pipeline.tensors(images, pixels, shared))
                      ).fields
        outputs = model_outputs(pipeline, fields, [o.name for o in request.outputs], side)
        response = pb.ModelInferResponse(model_name=pipeline.name, model_version=str(pipeline.entry.version),
                                         id=request.id)
        response.parameters["plan"].string_param = pipeline.plan or ""
        for name, value in outputs.items():
            response.outputs.add(name=name, datatype="FP32", shape=value.shape)
            # one written to shared memory has no data here: an empty raw content keeps the others' places
            response.raw_output_contents.append(b"" if name in shared else value.tobytes())
        return response


def peer_host(peer: str) -> str | None:
    """The address in a gRPC peer ("ipv4:127.0.0.1:5555", "ipv6:%5B::1%5D:5555"); None for a Unix socket
    ("unix:..."); a peer of another kind as it is (no IP address, so not local)."""
    kind, _, where = peer.partition(":")
    if kind.startswith("unix"):  # unix: and unix-abstract:
        return None
    if kind in ("ipv4", "ipv6"):
        return unquote(where).rpartition(":")[0].strip("[]")
    return peer


def parameters(given) -> dict:
    """A parameters map's values (InferParameter's one set field each)."""
    return {key: getattr(value, value.WhichOneof("parameter_choice")) for key, value in given.items()
            if value.WhichOneof("parameter_choice")}


def string_values(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None) -> list[bytes]:
    """A BYTES input's elements: its `raw_input_contents` (Triton's length-prefixed form) or its `bytes_contents`."""
    return bytes_elements(raw, tensor.name) if raw is not None else list(tensor.contents.bytes_contents)


def tensor_values(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None, dtype: np.dtype) -> np.ndarray:
    """An input's values, flat: its `raw_input_contents` (little-endian bytes) or its typed `contents`."""
    if raw is not None:
        try:
            return np.frombuffer(raw, dtype)
        except ValueError:  # not a whole number of values
            raise BadInput(f"input {tensor.name!r}: {len(raw)} bytes are no whole number of {dtype.itemsize}-byte "
                           "values") from None
    contents = tensor.contents
    if dtype == np.uint8:
        values = np.asarray(contents.uint_contents, np.uint32)
        if values.size and values.max() > 255:
            raise BadInput("UINT8 contents hold values above 255")
        return values.astype(np.uint8)
    return np.asarray(contents.fp32_contents, dtype)


async def start(pipelines: Pipelines, settings: Settings, metrics: Metrics, shared_port: bool) -> grpc.aio.Server:
    """The gRPC server on settings.grpc_port, started; `shared_port`: bound with SO_REUSEPORT, beside the other
    HTTP workers' servers. Messages are bounded as HTTP bodies are (VITSERVE_MAX_UPLOAD_BYTES)."""
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", settings.max_upload_bytes),
                                      ("grpc.so_reuseport", int(shared_port))])
    service = InferenceService(pipelines, settings, metrics)
    handlers = {name: grpc.unary_unary_rpc_method_handler(getattr(service, name), request.FromString,
                                                          response.SerializeToString)
                for name, (request, response) in RPCS.items()}
    handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
        service.ModelStreamInfer, pb.ModelInferRequest.FromString, pb.ModelStreamInferResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_insecure_port(f"{settings.host}:{settings.grpc_port}")  # a port in use raises here
    await server.start()
    return server
