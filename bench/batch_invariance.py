"""How far an image's answer moves with its batchmates, per model and CPU plan: the largest |change| of a photo's
logits (and embeddings) between the photo alone and the photo beside 15 noise images, in one batch, as the service
runs the plan (cpu_plans.open_runner: dynamic int8 one image at a time) and as the plan's graph runs the whole batch.

    python bench/batch_invariance.py                    # the embedded models, every plan this host runs
    python bench/batch_invariance.py --models shapes-vit --photos chelsea astronaut coffee
"""
import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from service_process import model_pixels, photo_bytes  # noqa: E402

from repository import read_entry, verify_file  # noqa: E402
from service.engine.backends.lifecycle import input_names  # noqa: E402
from service.engine.cpu_plans import PerImage, open_runner, verified, why_not  # noqa: E402

MODELS = ["shapes-vit", "shapes-deit", "shapes-swin", "expression-vit", "shapes-vit-int8"]


def largest_change(runner, photo: np.ndarray, noise: np.ndarray) -> dict[str, float]:
    """By output: the largest |change| of the photo's row between alone and first of a batch with the noise."""
    none = np.zeros((0, 3, *photo.shape[1:3]), np.float32)
    alone, beside = runner.run(photo, none), runner.run(np.concatenate([photo, noise]), none)
    return {name: float(np.abs(beside[name][:1] - alone[name]).max()) for name in ("logits", "embeddings")
            if name in alone}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=MODELS)
    p.add_argument("--photos", nargs="+", default=["chelsea", "astronaut", "coffee"])
    args = p.parse_args()
    print(f"{'model':<16} {'plan':<18} {'served: logits':>15} {'embeddings':>11} {'whole batch: logits':>20} "
          f"{'embeddings':>11}   (largest |change| over {len(args.photos)} photos, each beside 15 noise images)")
    for model in args.models:
        entry = read_entry(ROOT / "model_repository" / model)
        h, w = entry.policy.size
        noise = np.random.default_rng(0).integers(0, 256, (15, h, w, 3), np.uint8)
        photos = [model_pixels(entry.folder, photo_bytes(name, "JPEG"))[None] for name in args.photos]
        for plan in verified(entry):
            if (why := why_not(plan)) is not None:
                print(f"{model:<16} {plan.name:<18} not run here: {why}")
                continue
            path = entry.path() if plan.file == "model" else verify_file(entry, plan.file)
            served = open_runner(path, input_names(entry), plan, 0, False, False)
            whole = served.runner if isinstance(served, PerImage) else served
            found = {kind: [largest_change(runner, photo, noise) for photo in photos]
                     for kind, runner in (("served", served), ("whole", whole))}
            cells = [f"{max(c[name] for c in found[kind]):.2e}" for kind in ("served", "whole")
                     for name in ("logits", "embeddings")]
            print(f"{model:<16} {plan.name:<18} {cells[0]:>15} {cells[1]:>11} {cells[2]:>20} {cells[3]:>11}",
                  flush=True)


if __name__ == "__main__":
    main()
