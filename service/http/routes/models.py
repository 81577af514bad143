"""GET /models: what is served, how (the precision and provider that actually run), whether it is ready, and
what finds faces for /expression."""
from fastapi import APIRouter, Request

from service.engine.backends import ModelStatus
from service.pipeline.pipeline import Pipeline
from service.pipeline.served import Pipelines

from ..schemas import FaceDetectorInfo, ModelInfo, ModelsResponse

router = APIRouter(tags=["models"])


def model_info(pipeline: Pipeline, status: ModelStatus) -> ModelInfo:
    m = pipeline.entry.manifest
    return ModelInfo(
        name=pipeline.name, version=pipeline.entry.version, architecture=m["architecture"], family=m["family"],
        task=m["task"], labels=m["labels"], scores=pipeline.entry.scores,
        input_size=m["input"]["size"], preprocessing=pipeline.entry.preprocessing,
        precision=status.precision or m["precision"], provider=status.provider, plan=status.plan,
        plan_reason=status.plan_reason, plan_measured=status.plan_measured,
        graph=status.graph, decode=status.decode, decode_reason=status.decode_reason, ready=status.ready,
        error=status.error, attention=pipeline.entry.attention, explain=pipeline.entry.has("explain"),
        relevance=pipeline.entry.manifest.get("relevance"), embedding=pipeline.entry.embedding, text=m.get("text"),
        parity=m["parity"])


@router.get("/models", response_model=ModelsResponse, summary="The served models")
async def list_models(request: Request) -> ModelsResponse:
    pipelines: Pipelines = request.app.state.pipelines
    status = pipelines.backend.status()
    return ModelsResponse(default_model=pipelines.default_model,
                          default_expression_model=pipelines.default_expression_model,
                          models=[model_info(p, status[p.key]) for p in pipelines.every()],
                          not_served=pipelines.backend.problems, face_detector=face_detector_info(pipelines))


def face_detector_info(pipelines: Pipelines) -> FaceDetectorInfo | None:
    if pipelines.detector_problem is None and pipelines.detector is None:
        return None  # no expression model: none was looked for
    detector = pipelines.detector
    return FaceDetectorInfo(name=detector and detector.name, provider=detector and detector.provider,
                            landmarks=detector.landmark_names if detector else [], error=pipelines.detector_problem)
