"""The service's fast preprocessing (service/images/decode.py model_input: OpenCV's bilinear warp of the crop) against
the reference one (resize_and_crop: Pillow's filter of the policy, what the models were trained with): the pixels,
and the embedded models' top-1 agreement on their held-out images.

    python bench/preprocess_agreement.py            # needs data/ (make models writes the held-out sets)

Each held-out image (96 or 112 px) is first made a photo of another size, as uploads are: scaled by Pillow's
bicubic to a random short side of 1 to 5 times the model's resize_short_side, a random aspect of 3:4 to 4:3, and
saved as a JPEG (quality 90). Then both preprocessings decode it as the service does (draft mode: JPEGs decode
reduced by a power of two where that still covers the input) and the model's graph classifies both.
"""
import argparse
import io
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from repository import graph_inputs, read_entry  # noqa: E402
from service.images.decode import decode, model_input, resize_and_crop  # noqa: E402

DATA = {"shapes-vit": "shapes", "shapes-deit": "shapes", "shapes-swin": "shapes", "expression-vit": "faces"}


def as_upload(path: Path, short_side: int, rng: np.random.Generator) -> bytes:
    """The held-out image as a JPEG photo at a random size around the model's input."""
    image = Image.open(path).convert("RGB")
    short = int(short_side * rng.uniform(1, 5))
    aspect = rng.uniform(3 / 4, 4 / 3)
    size = (short, int(short * aspect)) if rng.random() < 0.5 else (int(short * aspect), short)
    buffer = io.BytesIO()
    image.resize(size, Image.BICUBIC).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(DATA), choices=list(DATA))
    p.add_argument("--data", type=Path, default=ROOT / "data")
    p.add_argument("--limit", type=int, help="held-out images per model (default: all)")
    args = p.parse_args()
    print(f"{'model':<15} {'images':>6} {'agreement':>9} {'accuracy fast':>13} {'reference':>9} "
          f"{'mean |diff|':>11} {'p99 |diff|':>10}")
    for name in args.models:
        entry = read_entry(ROOT / "model_repository" / name)
        policy, labels = entry.policy, entry.manifest["labels"]
        files = sorted((args.data / DATA[name] / "val").glob("*/*.png"))[:args.limit]
        rng = np.random.default_rng(0)
        fast, reference, truth = [], [], []
        for path in files:
            photo = decode(as_upload(path, policy.resize_short_side, rng), policy.resize_short_side, 10**8).image
            fast.append(model_input(photo, policy))
            reference.append(np.asarray(resize_and_crop(photo, policy)))
            truth.append(labels.index(path.parent.name))
        session = ort.InferenceSession(entry.path(), providers=["CPUExecutionProvider"])
        top1 = {}
        for kind, pixels in (("fast", np.stack(fast)), ("reference", np.stack(reference))):
            top1[kind] = np.concatenate([session.run(["logits"], graph_inputs(pixels[i:i + 64]))[0].argmax(1)
                                         for i in range(0, len(pixels), 64)])
        diff = np.abs(np.stack(fast).astype(int) - np.stack(reference))
        print(f"{name:<15} {len(files):>6} {np.mean(top1['fast'] == top1['reference']):>9.4f} "
              f"{np.mean(top1['fast'] == truth):>13.4f} {np.mean(top1['reference'] == truth):>9.4f} "
              f"{diff.mean():>11.2f} {np.percentile(diff, 99):>10.0f}")


if __name__ == "__main__":
    main()
