"""Service settings, read from the environment (prefix VITSERVE_, e.g. VITSERVE_MAX_BATCH_SIZE=32)."""
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

EMBEDDED_REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
# one model's CPU plan in VITSERVE_CPU_PLAN: [NAME=](auto|measure|first|RUNTIME:PRECISION)
PLAN_SPEC = r"([\w.@-]+=)?(auto|measure|first|(onnxruntime|openvino):(fp32|bf16|int8))"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VITSERVE_", env_file=".env", extra="ignore",
                                      protected_namespaces=())

    backend: Literal["auto", "thread", "process"] = Field(
        "auto", description="thread: sessions and batching in the one server process; process: HTTP worker "
                            "processes hand shared-memory records to one inference process; auto: process where "
                            "CUDA serves, thread on a CPU")
    workers: int = Field(0, ge=0, description="HTTP worker processes of the process backend (0: one per core, less "
                                              "one for the inference process, at least 2)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    grpc_port: int = Field(8001, ge=0, le=65535, description="the Open Inference Protocol over gRPC on this port "
                                                            "(0: off)")
    model_repository: Path = EMBEDDED_REPOSITORY
    model_control: Literal["none", "explicit", "poll"] = Field(
        "none", description="none: the models of start-up, until shutdown; explicit: POST "
                            "/v2/repository/models/NAME/load and /unload (re)load and unload them while serving; poll: "
                            "the repository is rescanned every POLL_S seconds and what changed is applied")
    poll_s: float = Field(10.0, gt=0, description="with MODEL_CONTROL=poll, seconds between rescans")
    default_model: str | None = Field(None, description="model for requests that name none (default: the first "
                                                        "classification model, by name)")
    default_expression_model: str | None = Field(None, description="expression model for /expression requests that "
                                                                   "name none (default: the first expression model, "
                                                                   "by name: expression-fer2013 of the embedded ones)")
    max_batch_size: int = Field(16, ge=1, le=1024, description="images per inference call")
    priority_levels: int = Field(2, ge=1, le=100, description="request priority levels (Triton's): 1 is taken into "
                                                              "a batch first; this last level is the default")
    priority_aging_ms: float = Field(200.0, ge=0, description="an image that has waited this long is taken as a "
                                                              "first-level one, so that no level starves")
    max_queue_delay_ms: float = Field(5.0, ge=0, description="how long the oldest queued image may wait for a batch "
                                                           "to fill, while other requests are still decoding")
    queue_limit: int = Field(256, ge=1, description="queued images per model beyond which requests get 503; "
                                                   "one request with more gets 413")
    request_timeout_s: float = Field(30.0, gt=0, description="longest wait for a result before 503")
    header_timeout_s: float = Field(60.0, gt=0, description="a connection that has not sent a whole request head "
                                                            "this long after it opened or got its last answer is "
                                                            "closed (408 if it sent part of one): nginx's "
                                                            "client_header_timeout; so an idle kept-alive "
                                                            "connection stays open this long")
    inference_unready_after_s: float = Field(30.0, gt=0, description="process backend: the inference process "
                                             "silent this long (its event loop stopped, or waiting work with no "
                                             "batch finished) makes /health/ready 503 and requests 503")
    inference_kill_after_s: float = Field(120.0, gt=0, description="process backend: silent this long, the "
                                          "inference process is killed and another started; keep it above the "
                                          "longest batch a model may take")
    inference_max_crashes: int = Field(5, ge=1, description="process backend: the inference process is started "
                                       "again after it dies or hangs, unless this is the crash number this many "
                                       "within INFERENCE_CRASH_WINDOW_S: then the service exits 1, for its "
                                       "orchestrator to see")
    inference_crash_window_s: float = Field(600.0, gt=0, description="the window INFERENCE_MAX_CRASHES counts in")
    device_broken_batches: int = Field(3, ge=0, description="batches of which no image ran, in a row, that make "
                                       "the device broken (a poisoned CUDA context fails every one): the process "
                                       "backend's inference process then exits and is started again, the thread "
                                       "backend turns unready and exits 75; 0: never")
    device_broken_s: float = Field(2.0, ge=0, description="and at least this long from the first of them to the "
                                                         "last, so that the batches in flight at one moment of "
                                                         "trouble are not enough")
    access_log: bool = Field(True, description="a line per request (uvicorn's access log, at log level info); "
                                               "off for the last bit of throughput")
    api_key: SecretStr | None = Field(None, description="if set, every route but health, metrics and the docs needs "
                                                        "it in the X-API-Key header (401 without it)")
    cors_origins: list[str] = Field([], description='origins whose browser pages may call the API, e.g. '
                                                    '["https://app.example.com"] or ["*"] (default: none)')
    max_upload_bytes: int = Field(16 * 2**20, ge=1, description="request body limit; larger requests get 413")
    max_json_bytes: int = Field(4 * 2**20, ge=1, description="limit of a /v2 request's JSON (413 past it): larger "
                                                            "tensors travel in binary (the binary tensor extension)")
    max_image_pixels: int = Field(50_000_000, ge=1, description="decoded image size limit (decompression bombs)")
    max_files: int = Field(64, ge=1, description="images per /classify request")
    max_texts: int = Field(2048, ge=1, description="texts per POST /v1/embeddings request (OpenAI's own limit), and "
                                                   "labels per zero-shot /classify request (413 past it)")
    max_text_chars: int = Field(2000, ge=1, description="characters of a text, a label or a prompt template (413 "
                                                        "past it); tokens past the model's context are cut, as "
                                                        "transformers cuts them")
    label_cache_bytes: int = Field(64 * 2**20, ge=0, description="memory for zero-shot labels' text vectors, kept "
                                                                 "by model, template and label, so that labels seen "
                                                                 "before cost no text run (each HTTP worker its own)")
    shared_memory: Literal["local", "any", "false"] = Field(
        "local", description="Triton's system shared-memory extension: clients register regions of /dev/shm files "
                             "and pass /v2 tensors through them, and a client can have the server map any /dev/shm "
                             "file its user may read and write (docs/api.md). local: only clients on loopback or a "
                             "Unix socket; any: every client that reaches the port (a sidecar behind a bridge "
                             "network); false: off, its routes answer 403. true, from before local and any, is "
                             "local")

    @field_validator("cpu_plan_dir", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("shared_memory", mode="before")
    @classmethod
    def _shared_memory_was_a_bool(cls, value: object) -> object:
        """The setting was a bool: on reads as local, the safe meaning (a client that is not on this host has no
        use for it), off as false."""
        word = str(value).lower()
        return {"true": "local", "1": "local", "yes": "local", "on": "local",
                "0": "false", "no": "false", "off": "false"}.get(word, word)

    providers: list[str] | None = Field(None, description="ONNX Runtime providers to try, best first "
                                                          "(default: CUDA if it starts here, then CPU)")
    cuda_tf32: bool = Field(False, description="fp32 graphs on CUDA may use TF32 tensor cores: faster matrix "
                                              "products, errors near 1e-3; off, fp32 sessions give the CPU's "
                                              "answers to 1e-4 (the export gate's tolerance), and fp16 is the fast "
                                              "path")
    # what CUDA graphs gained on an H100: docs/performance.md#h100-figures
    cuda_graph_max_batch: int = Field(0, ge=0, le=64, description="on CUDA, batches of up to this many images "
                                      "replay as CUDA graphs, one per power of two, each with its own copy of "
                                      "the weights on the GPU; 0: off")
    cuda_blocking_sync: bool = Field(False, description="on CUDA, a thread waiting for the GPU sleeps until it is "
                                     "woken (CU_CTX_SCHED_BLOCKING_SYNC) instead of spinning a core, which CUDA "
                                     "does by default while it has fewer contexts than the host has cores")
    iobinding: bool = Field(False, description="on the CPU too, run every batch through ONNX Runtime's IOBinding "
                                              "with reused batch buffers, as CUDA always does: a host without a "
                                              "GPU (CI) then exercises the device path")
    # off by default: on an H200 it was slower than the CPU's decoding (docs/performance.md#the-gpu-check-2026-11-27)
    gpu_decode: bool = Field(False, description="on CUDA, decode JPEGs on the GPU with nvImageCodec, in batches, "
                                                "where it and CuPy are installed (the `gpu` extra); else Pillow")
    gpu_decode_queue_batches: float = Field(2.0, ge=0, description="with GPU decoding on, JPEGs go to the GPU's "
                                            "decoder while fewer than this many batches per inference thread of "
                                            "them wait for it; past that, uploads are decoded on the CPU: the "
                                            "split follows the load (docs/serving.md)")
    cpu_plan: str = Field("auto", pattern=rf"^{PLAN_SPEC}(,{PLAN_SPEC})*$",
                          description="on a CPU host, the runtime and precision of the models: auto, the fastest "
                                      "here of the plans its export verified, measured at the first start on a host "
                                      "and kept (CPU_PLAN_DIR); measure, measured anew (and kept); first, the first "
                                      "of them this host runs, unmeasured; or one pinned, RUNTIME:PRECISION "
                                      "(onnxruntime or openvino, fp32, bf16 or int8), for every model whose export "
                                      "verified it (the others take auto); or per model, NAME=PLAN,... beside one "
                                      "for the rest: a model whose export did not verify the plan named for it fails "
                                      "to load, saying which it did")
    cpu_plan_dir: Path | None = Field(Path.home() / ".cache" / "vitserve" / "cpu-plans",
                                      description="where the plans measured are kept, one file per host and graph, "
                                                  "for every later start, process and replica on the host (empty: "
                                                  "none kept, each start measures)")
    strict_readiness: bool = Field(True, description="/health/ready and /v2/health/ready answer 200 only when every "
                                                     "model of the repository serves (Triton's --strict-readiness); "
                                                     "false: when one does and none is still loading")
    intra_op_threads: int = Field(0, ge=0, description="threads per inference (0: one per core)")
    decode_threads: int = Field(0, ge=0, description="image-decoding threads per process (0: the thread backend one "
                                                     "per core, at most 8; each HTTP worker of the process backend "
                                                     "its share of the cores, at least one)")
    spin_wait: bool = Field(True, description="on the CPU, ONNX Runtime's threads spin while a batch runs, never "
                                              "between batches: a lone request's answer sooner (CUDA sessions never "
                                              "spin)")
    warmup_runs: int = Field(2, ge=0, description="inference runs per model and batch size before ready")
    retry_after_s: int = Field(1, ge=1, description="the Retry-After of 503 answers")
    attention_cache_items: int = Field(1024, ge=1, description="attention results kept for GET /attention-map")
    attention_cache_bytes: int = Field(256 * 2**20, ge=1, description="memory those results may take")
    response_cache_bytes: int = Field(0, ge=0, description="memory for /classify answers kept by a hash of the "
                                                           "upload, so that a repeated image is answered without a "
                                                           "decode or a batch (each HTTP worker its own); 0: off")
    attention_ttl_s: float = Field(600.0, gt=0, description="how long an attention result stays retrievable")
    face_max: int = Field(20, ge=1, le=100, description="faces classified per image, largest first")
    face_request_max: int = Field(256, ge=1, description="faces classified per /expression request, all its photos "
                                  "together (the model's queue limit bounds it too): past it the request is a 413 "
                                  "too_many_faces and its photos not yet detected are not. 256, the default queue "
                                  "limit: 64 files of up to 20 faces would be 1,280 images in one request")
    face_min_size: int = Field(32, ge=12, description="smallest face side, in pixels, the detector looks for (in "
                                                       "a photo larger than FACE_DETECT_SIDE, at least 12 pixels "
                                                       "of the copy detection runs on)")
    face_detect_side: int = Field(1024, ge=64, description="detection runs on a copy at most this large (its cost "
                                                           "grows with its pixels)")
