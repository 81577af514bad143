"""Write a synthetic dataset as an ImageFolder: OUT/{train,val}/<label>/<index>.png, with OUT/labels.txt
(the class order) and OUT/{train,val}/boxes.json (each image's object box, x y w h in pixels).

    python -m models.synthetic shapes --out data/shapes --train 12000 --val 1200 --seed 0
    python -m models.synthetic faces --out data/faces --train 14000 --val 1400 --seed 0

The validation split uses seed + 1: no image is shared with the training split.
"""
import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

from tqdm import tqdm

from . import sample_rng
from .faces import LABELS as FACE_LABELS
from .faces import render_face
from .shapes import LABELS as SHAPE_LABELS
from .shapes import render_shape

KINDS = {"shapes": (render_shape, SHAPE_LABELS, 96), "faces": (render_face, FACE_LABELS, 112)}


def _write_one(index: int, kind: str, seed: int, size: int, split_dir: Path) -> tuple[str, list[int]]:
    render, labels, _ = KINDS[kind]
    sample = render(sample_rng(seed, index), size, label=index % len(labels))
    name = f"{labels[sample.label]}/{index:06d}.png"
    sample.image.save(split_dir / name)
    return name, list(sample.box)


def write_split(kind: str, out: Path, split: str, count: int, seed: int, size: int, workers: int) -> None:
    split_dir = out / split
    for label in KINDS[kind][1]:
        (split_dir / label).mkdir(parents=True, exist_ok=True)
    job = partial(_write_one, kind=kind, seed=seed, size=size, split_dir=split_dir)
    with ProcessPoolExecutor(workers) as pool:
        boxes = dict(tqdm(pool.map(job, range(count), chunksize=64), total=count, desc=f"{kind} {split}",
                          file=sys.stderr))
    (split_dir / "boxes.json").write_text(json.dumps(boxes, sort_keys=True))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.synthetic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--train", type=int, default=12000, help="training images")
    parser.add_argument("--val", type=int, default=1200, help="held-out images")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, help="image side in pixels (shapes 96, faces 112)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    size = args.size or KINDS[args.kind][2]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "labels.txt").write_text("\n".join(KINDS[args.kind][1]) + "\n")
    write_split(args.kind, args.out, "train", args.train, args.seed, size, args.workers)
    write_split(args.kind, args.out, "val", args.val, args.seed + 1, size, args.workers)


if __name__ == "__main__":
    main()
