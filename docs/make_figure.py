"""Redraw docs/attention_map.png and docs/relevance_map.png from a running service.

    make serve &                      # the embedded demo models
    python docs/make_figure.py        # --url http://127.0.0.1:8000

relevance_map.png: one held-out image with two shapes of two classes, one in each half (models.synthetic.shapes),
sent to POST /attention-map on shapes-vit: the map of each of its two labels (method=relevance&label=...) beside
the last block's map, which is the same whatever the label.

attention_map.png: a real photograph (scikit-image's astronaut) goes to POST
/expression?attention=true&model=expression-vit (the default expression model, a CNN, has no attention maps); the
figure shows the face box and landmarks the service found and the face's maps from GET /attention-map, last layer
and rollout, over the aligned face the model saw, exactly as the service returns them.
"""
import argparse
import io
import sys
from pathlib import Path

import httpx
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from PIL import Image
from skimage import data

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from models.synthetic import sample_rng  # noqa: E402
from models.synthetic.shapes import LABELS, two_shapes  # noqa: E402

OUT = Path(__file__).resolve().parent / "attention_map.png"
RELEVANCE_OUT = Path(__file__).resolve().parent / "relevance_map.png"
TWO_SHAPES = (7_000_000, 11)  # (seed, index): a held-out image of bench/relevance.py's two-shape set


def relevance_figure(client: httpx.Client) -> None:
    image, labels, _ = two_shapes(sample_rng(*TWO_SHAPES))
    png = io.BytesIO()
    image.save(png, "PNG")
    panels = [("the image", image)]
    for params in ({"method": "relevance", "label": LABELS[labels[0]]},
                   {"method": "relevance", "label": LABELS[labels[1]]}, {"method": "last"}):
        reply = client.post("/attention-map", params={"model": "shapes-vit", "max_side": 384, **params},
                            files={"file": ("two.png", png.getvalue(), "image/png")})
        reply.raise_for_status()
        title = f"relevance, label={params['label']}" if "label" in params else "last (any label)"
        panels.append((title, Image.open(io.BytesIO(reply.content))))
    fig, axes = plt.subplots(1, 4, figsize=(12, 3.4))
    for ax, (title, picture) in zip(axes, panels):
        ax.imshow(np.asarray(picture.resize((384, 384), Image.NEAREST)))
        ax.set_title(title, fontsize=10)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(RELEVANCE_OUT, dpi=100, bbox_inches="tight")
    print(f"wrote {RELEVANCE_OUT}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    args = p.parse_args()
    photo = Image.fromarray(data.astronaut())
    jpeg = io.BytesIO()
    photo.save(jpeg, "JPEG", quality=92)
    with httpx.Client(base_url=args.url, timeout=60) as client:
        relevance_figure(client)
        reply = client.post("/expression", params={"attention": "true", "model": "expression-vit"},
                            files={"file": ("astronaut.jpg", jpeg.getvalue(), "image/jpeg")})
        reply.raise_for_status()
        face = reply.json()["faces"][0]
        maps = {}
        for method in ("last", "rollout"):
            image = client.get(f"{face['attention_map_url']}&method={method}")
            image.raise_for_status()
            maps[method] = Image.open(io.BytesIO(image.content))

    fig, axes = plt.subplots(1, 3, figsize=(10.5, 3.6))
    x, y, w, h = face["box"]
    axes[0].imshow(photo)
    axes[0].add_patch(plt.Rectangle((x, y), w, h, fill=False, color="lime", linewidth=2))
    axes[0].scatter(*zip(*face["landmarks"].values()), s=14, color="yellow", edgecolors="black", linewidths=0.5)
    axes[0].set_title(f"POST /expression: {face['expression']} ({face['score']:.2f})", fontsize=10)
    for ax, (method, image) in zip(axes[1:], maps.items()):
        ax.imshow(image)
        ax.set_title(f"GET /attention-map?method={method}", fontsize=10)
    for ax in axes:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(OUT, dpi=100, bbox_inches="tight")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
