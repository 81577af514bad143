"""What attention maps cost.

    python bench/attention_cost.py
    python bench/attention_cost.py --rounds 30 --graph-model deit_small_patch16_224

1. /classify latency with attention=false vs attention=true, one image per request (batch 1) and 16 images
   per request (batch 16), requests alternating in one run; medians and their ratio.
2. GET /attention-map: method=last (from the kept outputs) vs method=rollout (runs explain.onnx), as JSON;
   and method=last as a PNG (drawn over the upload, decoded again at its own size).
3. The graph itself: the served graph (logits + attention rows) vs a logits-only export of the same weights,
   raw ONNX Runtime sessions, alternating; this is what the always-on attention outputs cost.
"""
import argparse
import io
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import torch
from PIL import Image
from skimage import data as photos
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from export.graph import ImageInput, MainGraph, export_graph  # noqa: E402
from models import create_model  # noqa: E402
from repository import graph_inputs  # noqa: E402
from service_process import running_service  # noqa: E402


class LogitsOnly(nn.Module):
    output_names = ["logits"]

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model.eval()
        self.input = ImageInput(model.spec.mean, model.spec.std)

    def forward(self, images: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(self.input(images, pixel_values))


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def alternate(calls: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each call, run in a shuffled order every round."""
    for call in calls.values():
        call()
    times = {k: [] for k in calls}
    for _ in range(rounds):
        for k in random.sample(list(calls), len(calls)):
            times[k].append(timed(calls[k]))
    return {k: statistics.median(v) for k, v in times.items()}


def http_costs(model: str, rounds: int) -> None:
    buf = io.BytesIO()
    Image.fromarray(photos.chelsea()).save(buf, format="JPEG", quality=90)
    jpeg = buf.getvalue()
    with running_service() as url, httpx.Client(base_url=url, timeout=60) as client:
        for batch in (1, 16):
            files = [("files", (f"{i}.jpg", jpeg)) for i in range(batch)]
            post = lambda attention: client.post("/classify", files=files,  # noqa: E731
                                                 params={"model": model, "attention": attention})
            med = alternate({"off": lambda: post("false"), "on": lambda: post("true")}, rounds)
            print(f"/classify {model} batch {batch:>2}: attention=false {med['off'] * 1e3:7.1f} ms, "
                  f"attention=true {med['on'] * 1e3:7.1f} ms, ratio {med['on'] / med['off']:.3f}")
        key = client.post("/classify", files={"file": ("a.jpg", jpeg)},
                          params={"model": model, "attention": "true"}).json()["results"][0]["id"]
        get = lambda method, fmt: client.get("/attention-map", params={"id": key, "method": method, "format": fmt})  # noqa: E731
        med = alternate({"last": lambda: get("last", "json"), "rollout": lambda: get("rollout", "json"),
                         "png": lambda: get("last", "png")}, rounds)
        print(f"GET /attention-map {model}: method=last {med['last'] * 1e3:.1f} ms, "
              f"method=rollout {med['rollout'] * 1e3:.1f} ms (explain graph), JSON; method=last as a PNG at the "
              f"upload's size {med['png'] * 1e3:.1f} ms (its JPEG decoded again)")


def graph_costs(name: str, rounds: int, cache: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = create_model(name)
    size = model.spec.img_size
    paths = {"logits only": cache / f"{name}.uint8.logits.onnx",
             "served (logits + attention)": cache / f"{name}.uint8.onnx"}
    for (kind, path), module in zip(paths.items(), (LogitsOnly(model), MainGraph(model))):
        if not path.exists():
            export_graph(module, size, path)
    sessions = {k: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for k, p in paths.items()}
    for batch in (1, 16):
        x = graph_inputs(np.random.default_rng(0).integers(0, 256, (batch, size, size, 3), np.uint8))
        med = alternate({k: (lambda s: lambda: s.run(None, x))(s) for k, s in sessions.items()}, rounds)
        base, served = med["logits only"], med["served (logits + attention)"]
        print(f"graph {name} batch {batch:>2}: logits only {base * 1e3:7.1f} ms, with attention outputs "
              f"{served * 1e3:7.1f} ms, ratio {served / base:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="shapes-deit", help="a model of the embedded repository")
    p.add_argument("--graph-model", default="deit_small_patch16_224", help="registry model for part 3")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--cache", type=Path, default=ROOT / "build" / "bench")
    args = p.parse_args()
    http_costs(args.model, args.rounds)
    graph_costs(args.graph_model, max(5, args.rounds // 2), args.cache)


if __name__ == "__main__":
    main()
