"""Response bodies of the HTTP API (the OpenAPI docs at /docs are generated from these)."""
from pydantic import BaseModel, Field


class Prediction(BaseModel):
    label: str
    index: int = Field(description="class index in the model's labels")
    score: float = Field(description="the label's probability: softmax over the labels, or the label's own sigmoid "
                                     "for a multi-label model (the response's `scores` says which)")


class Timings(BaseModel):
    decode_ms: float = Field(description="decoding and preprocessing this image")
    queue_ms: float = Field(description="waiting for its batch to start")
    inference_ms: float = Field(description="compute time of the batch it ran in")
    total_ms: float = Field(description="the whole request, as the server saw it")


class ImageResult(BaseModel):
    id: str = Field(description="this image's result id (the attention map's key with attention=true)")
    filename: str | None
    predictions: list[Prediction]
    batch_size: int = Field(description="images in the inference batch this one ran in (0: answered from the "
                                        "response cache, VITSERVE_RESPONSE_CACHE_BYTES)")
    timings_ms: Timings
    attention_map_url: str | None = None


class ImageError(BaseModel):
    """One upload of several that could not be read; the others are answered beside it."""
    filename: str | None
    error: dict[str, str] = Field(description="code (bad_image, image_too_large, unsupported_media_type) and message, "
                                              "as a whole request's error would say them")


PLAN = ("what computed the answers, RUNTIME:PRECISION: the CPU plan (onnxruntime or openvino; fp32, bf16 or int8), "
        "or onnxruntime-cuda and the precision on CUDA (GET /models says why)")


class ClassifyResponse(BaseModel):
    model_config = {"json_schema_extra": {"examples": [{
        "model": "shapes-deit", "plan": "onnxruntime:fp32", "scores": "softmax",
        "results": [{"id": "3f2b9c0e4d6a4f1b8e7c5a2d9b0c1e3f", "filename": "shape.png",
                     "predictions": [{"label": "star", "index": 3, "score": 0.9731},
                                     {"label": "cross", "index": 4, "score": 0.0112}],
                     "batch_size": 8, "timings_ms": {"decode_ms": 1.9, "queue_ms": 2.4, "inference_ms": 6.1,
                                                     "total_ms": 11.2},
                     "attention_map_url": "/attention-map?id=3f2b9c0e4d6a4f1b8e7c5a2d9b0c1e3f"}]}]}}

    model: str
    plan: str | None = Field(description=PLAN)
    scores: str = Field(description="softmax: the scores are one distribution over the labels; sigmoid: a "
                                    "multi-label model, each label's score on its own")
    results: list[ImageResult | ImageError] = Field(description="one entry per uploaded file, in order: its "
                                                               "predictions, or its error where it alone failed")


class Embedding(BaseModel):
    index: int = Field(description="the upload's place in the request, from 0")
    filename: str | None
    embedding: list[float] | str = Field(description="the vector: JSON floats, or with encoding=base64 its float32 "
                                                     "little-endian bytes in base64")
    batch_size: int = Field(description="images in the inference batch this one ran in (0: answered from the "
                                        "response cache)")
    timings_ms: Timings


class EmbeddingError(ImageError):
    index: int = Field(description="the upload's place in the request, from 0")


class EmbedResponse(BaseModel):
    model_config = {"json_schema_extra": {"examples": [{
        "model": "shapes-vit", "plan": "onnxruntime:fp32", "size": 4, "pooling": "final-norm [CLS] token",
        "normalized": True, "encoding": "json",
        "results": [{"index": 0, "filename": "shape.png", "embedding": [0.5, -0.5, 0.5, 0.5], "batch_size": 8,
                     "timings_ms": {"decode_ms": 1.9, "queue_ms": 2.4, "inference_ms": 6.1, "total_ms": 11.2}}]}]}}

    model: str
    plan: str | None = Field(description=PLAN)
    size: int = Field(description="the vectors' length")
    pooling: str = Field(description="how the model's tokens became the vector (its manifest's embedding.pooling)")
    normalized: bool = Field(description="whether each vector was L2-normalised (normalize, default true)")
    encoding: str = Field(description="json or base64, as asked")
    results: list[Embedding | EmbeddingError] = Field(description="one entry per uploaded file, in order: its "
                                                                 "vector, or its error where it alone failed")


class ModelInfo(BaseModel):
    name: str
    version: int = Field(description="the version serving: its folder's number (NAME/2/), 1 for a flat folder")
    architecture: str
    family: str
    task: str
    labels: list[str]
    scores: str = Field(description="softmax, or sigmoid for a multi-label model")
    input_size: list[int]
    preprocessing: dict = Field(description="what is done to an upload before the model: short side resized to "
                                            "resize_short_side (interpolation), or with resize_to [h, w] to exactly "
                                            "that size (a Hugging Face model's), centre crop of size [h, w], then "
                                            "(x / 255 - mean) / std, which the graph itself does to uint8 `images`")
    precision: str = Field(description="the precision that runs: an fp32 model with an fp16 sibling runs the "
                                       "sibling's graph on CUDA")
    provider: str | None = Field(description="the ONNX Runtime provider it runs on, once loaded (the CPU's for "
                                             "OpenVINO too)")
    plan: str | None = Field(None, description="on a CPU host, the runtime and precision that run it "
                                               "(RUNTIME:PRECISION), of those its export verified")
    plan_reason: str | None = Field(None, description="why that plan: the fastest measured here, the only one, "
                                                      "the first, or pinned by VITSERVE_CPU_PLAN")
    plan_measured: dict[str, dict[str, float]] | None = Field(
        None, description="images/s measured at load of each plan this host runs, by batch size")
    graph: str | None = Field(None, description="the model whose graph runs for this name")
    decode: str = Field("cpu", description="where its JPEGs are decoded: cpu (Pillow, in the HTTP workers) or gpu "
                                           "(nvImageCodec, with their batch, straight into the model's input)")
    decode_reason: str | None = Field(None, description="why decode is cpu although the model runs on CUDA with "
                                                        "GPU decoding on (the error that kept it from starting); "
                                                        "null where decode is gpu, or the model runs on the CPU, "
                                                        "or VITSERVE_GPU_DECODE is off")
    ready: bool
    error: str | None = None
    attention: dict | None = Field(description="how attention maps are computed for this model; null for a model "
                                               "without attention outputs (a CNN), whose maps every route refuses "
                                               "with 400")
    explain: bool = Field(description="whether rollout maps are available (explain.onnx)")
    relevance: dict | None = Field(None, description="how its class-specific maps (method=relevance: why this label) "
                                                     "are computed: the rule, the grid and the rows; null for a model "
                                                     "without a relevance graph (an embedding model)")
    embedding: dict | None = Field(None, description="the image embedding POST /embed answers with: the graph's "
                                                     "output, its size and how it pools the tokens; null for a model "
                                                     "without one (a CNN)")
    text: dict | None = Field(None, description="a whole CLIP's text tower: its size, context length, scoring rule "
                                                "(softmax or sigmoid), logit scale and bias and default prompt "
                                                "template, for zero-shot /classify?labels= and /v1/embeddings "
                                                "texts; null for a model without one")
    parity: dict = Field(description="the export's parity figures, from the manifest")


class FaceDetectorInfo(BaseModel):
    name: str | None = Field(description="the repository's face detector (null: none could be loaded)")
    provider: str | None
    landmarks: list[str] = Field(description="the landmarks each face of /expression gets, in this order")
    error: str | None = Field(description="why /expression cannot detect faces (it still serves detect=false)")


class ModelsResponse(BaseModel):
    default_model: str | None
    default_expression_model: str | None = Field(None, description="the model of /expression requests that name none")
    models: list[ModelInfo]
    not_served: dict[str, str] = Field(description="repository folders that failed validation, with why")
    face_detector: FaceDetectorInfo | None = Field(
        description="what finds faces for /expression (null where the repository has no expression model)")


class Face(BaseModel):
    id: str = Field(description="this face's result id (the attention map's key with attention=true)")
    box: list[int] = Field(description="[x, y, width, height] in the uploaded image's pixels (after EXIF rotation); "
                                       "with detect=false, the whole image")
    landmarks: dict[str, list[float]] | None = Field(
        description="the detector's five points, [x, y] in the image's pixels: left_eye, right_eye, nose, "
                    "mouth_left, mouth_right (left and right as seen in the image); the face was aligned by them "
                    "(null with detect=false)")
    detection_score: float | None = Field(description="the detector's face probability (null with detect=false)")
    expression: str = Field(description="the most probable expression")
    score: float
    probabilities: dict[str, float] = Field(description="every expression, in the model's label order")
    batch_size: int = Field(description="faces in the inference batch this one ran in")
    attention_map_url: str | None = None


class ExpressionTimings(BaseModel):
    decode_detect_ms: float = Field(description="decoding, face detection and alignment")
    queue_ms: float
    inference_ms: float
    total_ms: float


class ExpressionResponse(BaseModel):
    model_config = {"json_schema_extra": {"examples": [{
        "model": "expression-vit", "plan": "onnxruntime:fp32", "image_size": [512, 512],
        "faces": [{"id": "9c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f", "box": [181, 61, 87, 113],
                   "landmarks": {"left_eye": [204.5, 101.6], "right_eye": [247.1, 103.2], "nose": [225.6, 128.5],
                                 "mouth_left": [202.9, 140.3], "mouth_right": [245.1, 141.6]},
                   "detection_score": 0.9993, "expression": "happiness",
                   "score": 0.91, "probabilities": {"surprise": 0.02, "fear": 0.01, "disgust": 0.01,
                                                    "happiness": 0.91, "sadness": 0.01, "anger": 0.01,
                                                    "neutral": 0.03},
                   "batch_size": 1, "attention_map_url": None}],
        "timings_ms": {"decode_detect_ms": 14.2, "queue_ms": 0.3, "inference_ms": 2.8, "total_ms": 18.0}}]}}

    model: str
    plan: str | None = Field(description=PLAN)
    image_size: list[int] = Field(description="[width, height] after EXIF rotation")
    faces: list[Face]
    timings_ms: ExpressionTimings


class PhotoFaces(BaseModel):
    """One photo of several sent as `files` to /expression."""
    filename: str | None
    image_size: list[int] = Field(description="[width, height] after EXIF rotation")
    faces: list[Face]
    timings_ms: ExpressionTimings


class ExpressionResults(BaseModel):
    """/expression's answer to several photos (`files`)."""
    model: str
    plan: str | None = Field(description=PLAN)
    results: list[PhotoFaces | ImageError] = Field(description="one entry per photo, in order: its faces, or its "
                                                               "error where it alone could not be read")
