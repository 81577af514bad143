"""What a face costs on the CPU: expression-fer2013 (mini-Xception, 64 x 64 grey) against expression-vit (a micro
ViT, 112 x 112), the service's two expression models.

    python bench/expression_cost.py
    python bench/expression_cost.py --rounds 40 --threads 2

1. POST /expression, one request at a time to one service, the two models alternating in a shuffled order each
   round: the astronaut (one face) and her face five times at sides 70-180 and turns of -30 to 30 degrees (five
   faces, one batch); the median request, and the median of the model's own time for the batch (inference_ms),
   per face. Detection and alignment (decode_detect_ms) are the same work for both models.
2. The graphs alone, raw ONNX Runtime sessions on --threads threads: a batch of 1 and of 16 aligned faces;
   median ms per face.
"""
import argparse
import io
import statistics
import sys
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from attention_cost import alternate  # noqa: E402
from face_scenes import astronaut_five_times  # noqa: E402
from service_process import photo_bytes, running_service  # noqa: E402

from repository import graph_inputs, read_entry  # noqa: E402

MODELS = ("expression-fer2013", "expression-vit")


def jpeg(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def service_costs(rounds: int) -> None:
    photos = {"astronaut (1 face)": photo_bytes("astronaut", "JPEG"),
              "her face 5 times (5 faces)": jpeg(astronaut_five_times()[0])}
    with running_service() as url, httpx.Client(base_url=url, timeout=60) as client:
        for photo, data in photos.items():
            model_ms = {m: [] for m in MODELS}

            def post(model: str) -> None:
                body = client.post("/expression", files={"file": ("a.jpg", data)}, params={"model": model}).json()
                model_ms[model].append((body["timings_ms"]["inference_ms"], body["timings_ms"]["decode_detect_ms"],
                                        len(body["faces"])))

            medians = alternate({m: (lambda m=m: post(m)) for m in MODELS}, rounds)
            for m in MODELS:
                inference, detect, faces = (statistics.median(v) for v in zip(*model_ms[m]))
                print(f"/expression {photo:<27} {m:<19} request {medians[m] * 1e3:6.1f} ms, detect+align "
                      f"{detect:5.1f} ms, model {inference:5.2f} ms for the batch ({inference / faces:5.2f} per face)")
            print(f"  request ratio vit / fer2013: {medians[MODELS[1]] / medians[MODELS[0]]:.2f}")


def graph_costs(rounds: int, threads: int) -> None:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    rng = np.random.default_rng(0)
    for batch in (1, 16):
        calls = {}
        for name in MODELS:
            entry = read_entry(ROOT / "model_repository" / name)
            session = ort.InferenceSession(entry.path(), options, providers=["CPUExecutionProvider"])
            inputs = graph_inputs(rng.integers(0, 256, (batch, *entry.policy.size, 3), np.uint8))
            calls[name] = lambda s=session, x=inputs: s.run(["logits"], x)
        medians = alternate(calls, rounds)
        per_face = {m: medians[m] * 1e3 / batch for m in MODELS}
        ratio = per_face[MODELS[1]] / per_face[MODELS[0]]
        print(f"graph alone, batch {batch:>2}, {threads} thread(s): "
              + ", ".join(f"{m} {per_face[m]:.3f} ms/face" for m in MODELS) + f"; ratio {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    graph_costs(args.rounds * 4, args.threads)
    service_costs(args.rounds)


if __name__ == "__main__":
    main()
