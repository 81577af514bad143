"""What every peer server shares with vitserve: the graph, a plain ONNX Runtime session on it, and the service's
own preprocessing, imported from the project (numpy, Pillow, OpenCV, simplejpeg, pi-heif and jsonschema are all
it needs: bench/peers.py installs them), so every server feeds the graph the same pixels."""
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from repository import read_entry  # noqa: E402
from service.images.decode import upload_input  # noqa: E402

MODEL = ROOT / "model_repository" / "shapes-deit"
ENTRY = read_entry(MODEL)
POLICY = ENTRY.policy
LABELS: list[str] = ENTRY.manifest["labels"]
MAX_PIXELS = 50_000_000  # the service's default VITSERVE_MAX_IMAGE_PIXELS
OUTPUTS = ("logits", "cls_attention", "dist_attention")  # what the graph returns, and vitserve's /v2 with it


def session() -> ort.InferenceSession:
    """One CPU session with ONNX Runtime's defaults, as a peer's author would open it: a thread per core, spinning
    between runs (bench/peers.py pauses every server that is not under load, so an idle one takes no core)."""
    return ort.InferenceSession(MODEL / "model.onnx", providers=["CPUExecutionProvider"])


def preprocess(data: bytes) -> np.ndarray:
    """Image bytes -> the model's uint8 [H, W, 3] input, as vitserve decodes, resizes and crops it."""
    return upload_input(data, POLICY, MAX_PIXELS)


def run(session: ort.InferenceSession, images: np.ndarray) -> list[np.ndarray]:
    """The graph's outputs for uint8 [B, H, W, 3] images (its float input fed empty: both inputs are required)."""
    no_tensors = np.zeros((0, 3, *images.shape[1:3]), np.float32)
    return session.run(list(OUTPUTS), {"images": images, "pixel_values": no_tensors})


def top1(logits: np.ndarray) -> dict:
    """The best class of one image's logits, with its softmax probability."""
    p = np.exp(logits - logits.max())
    i = int(p.argmax())
    return {"label": LABELS[i], "index": i, "score": float(p[i] / p.sum())}
