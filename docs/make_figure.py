"""Redraw docs/attention_map.png from a running service.

    make serve &                      # the embedded demo models
    python docs/make_figure.py        # --url http://127.0.0.1:8000

A real photograph (scikit-image's astronaut) goes to POST /expression?attention=true&model=expression-vit (the
default expression model, a CNN, has no attention maps); the figure shows the face box and landmarks the service
found and the face's maps from GET /attention-map, last layer and rollout, over the aligned face the model saw,
exactly as the service returns them.
"""
import argparse
import io
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from PIL import Image
from skimage import data

OUT = Path(__file__).resolve().parent / "attention_map.png"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    args = p.parse_args()
    photo = Image.fromarray(data.astronaut())
    jpeg = io.BytesIO()
    photo.save(jpeg, "JPEG", quality=92)
    with httpx.Client(base_url=args.url, timeout=60) as client:
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
